"""Pure core (stdlib + numpy only): requests, blocks, KV cache manager, scheduler, cost model.

Shared by the engine and the simulator; importing it must never import torch.
"""
