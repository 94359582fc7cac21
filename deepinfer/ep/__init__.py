"""Data-parallel attention + expert-parallel MoE: rank processes stepping in lockstep, and the
front-side client that routes requests to ranks (see docs/expert_parallel.md)."""
