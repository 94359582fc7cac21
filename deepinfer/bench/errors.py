"""The benchmarks' user-error type. Library code here raises it; the CLI layer
(`deepinfer.cli.bench`) turns it into its one-line exit."""


class BenchError(ValueError):
    """Bad benchmark input (arguments, workload, unreachable or unsuitable server)."""
