"""Pipeline stages: which layers each stage runs, and where each rank stands in a ``pipeline × tensor`` grid.

Rank ``r`` of ``pipeline_size × tensor_size`` ranks is tensor-parallel rank
``r % tensor_size`` of stage ``r // tensor_size``; rank 0 (the engine's) is
the first rank of the first stage. Stage ``s`` runs a contiguous run of
layers; the embedding lives on the first stage, the final norm and the LM
head on the last. Without ``parallel.pipeline_layers`` the layers are split
as evenly as possible, the earlier stages taking one fewer where it does not
divide (the first holds the embedding, the last the LM head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kunlun_infer.errors import ConfigError
from kunlun_infer.models.base import LayerSpan


def split_layers(num_layers: int, pipeline_size: int, override: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per stage: ``override`` checked (``parallel.pipeline_layers``), or an even split."""
    if pipeline_size > num_layers:
        raise ConfigError(f"parallel.pipeline_size={pipeline_size} is more stages than the model's {num_layers} "
                          f"layers; use at most {num_layers}")
    if override is not None:
        counts = [int(n) for n in override]
        if len(counts) != pipeline_size or any(n < 1 for n in counts) or sum(counts) != num_layers:
            raise ConfigError(f"parallel.pipeline_layers={counts} must give each of the {pipeline_size} stages "
                              f"(parallel.pipeline_size) at least one layer and add up to the model's {num_layers} "
                              f"layers, e.g. {list(split_layers(num_layers, pipeline_size))}")
        return tuple(counts)
    base, extra = divmod(num_layers, pipeline_size)
    return tuple(base + (1 if s >= pipeline_size - extra else 0) for s in range(pipeline_size))


@dataclasses.dataclass(frozen=True)
class Grid:
    """``pipeline_size`` stages of ``tensor_size`` ranks, and the layers of each stage."""

    pipeline_size: int
    tensor_size: int
    stage_layers: tuple[int, ...]

    @classmethod
    def from_config(cls, cfg: Any, num_layers: int) -> Grid:
        parallel = cfg.parallel
        size = int(parallel.get("pipeline_size", 1))
        override = parallel.get("pipeline_layers")
        if override is not None and size == 1 and len(override) != 1:
            raise ConfigError(f"parallel.pipeline_layers={list(override)} needs parallel.pipeline_size="
                              f"{len(override)}")
        return cls(size, int(parallel.tensor_size), split_layers(num_layers, size, override))

    @property
    def world_size(self) -> int:
        return self.pipeline_size * self.tensor_size

    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor_size

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tensor_size

    def span(self, stage: int) -> LayerSpan:
        start = sum(self.stage_layers[:stage])
        return LayerSpan(start, start + self.stage_layers[stage], self.num_layers)

    def stage_ranks(self, stage: int) -> list[int]:
        """The tensor-parallel ranks of ``stage``, in order."""
        return list(range(stage * self.tensor_size, (stage + 1) * self.tensor_size))

    def next_rank(self, rank: int) -> int | None:
        """The same tensor-parallel rank of the next stage (``None`` on the last stage)."""
        stage = self.stage_of(rank)
        return None if stage == self.pipeline_size - 1 else rank + self.tensor_size

    def prev_rank(self, rank: int) -> int | None:
        """Where ``rank`` hears from: the same rank of the stage before, or rank 0 on the first stage."""
        if rank == 0:
            return None
        return 0 if self.stage_of(rank) == 0 else rank - self.tensor_size

    def last_stage_ranks(self) -> list[int]:
        return self.stage_ranks(self.pipeline_size - 1)

    def describe(self) -> str:
        """One line per stage: its layers and ranks (what ``plan`` prints)."""
        lines = []
        for stage in range(self.pipeline_size):
            span = self.span(stage)
            parts = (["embedding"] if span.is_first else []) + [f"layers {span.start}-{span.end - 1}"] \
                + (["norm + LM head"] if span.is_last else [])
            ranks = self.stage_ranks(stage)
            lines.append(f"stage {stage}: {', '.join(parts)} ({span.num_layers} layers) on rank"
                         f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}")
        return "\n".join(lines)
