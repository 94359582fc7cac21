"""The front's clients of its engines: one `EngineClient` interface (protocol.py), one factory
(factory.py) and an implementation per deployment shape (colocated, data-parallel,
disaggregated, EP-disaggregated)."""
