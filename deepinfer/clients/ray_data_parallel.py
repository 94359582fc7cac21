"""`RayDataParallelClient`: `DataParallelClient` whose rank groups are Ray placement groups
(`serve --cluster ray --data-parallel-size N`); placement and addressing: ep/ray_rank_group."""
from __future__ import annotations

from deepinfer.clients.data_parallel import DataParallelClient
from deepinfer.ep.ray_rank_group import RayGroupHandle, RayRankPlacement


class RayDataParallelClient(DataParallelClient):
    """`DataParallelClient` whose groups are placed on Ray."""

    def __init__(self, engine_config, ep_config, placement: RayRankPlacement, **kwargs) -> None:
        super().__init__(engine_config, ep_config, **kwargs)
        self.placement = placement
        self.groups = [RayGroupHandle(g.index, g.size, placement=placement) for g in self.groups]

    async def start(self) -> None:
        self.placement.check(self.groups[0].size)
        await super().start()

    async def shutdown(self) -> None:
        try:
            await super().shutdown()
        finally:
            self.placement.close()
