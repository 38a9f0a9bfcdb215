"""The preregistered workload: cells, token prompts from seeds, per-request sample seeds, partitions.

A cell is (prompt length x response length x samples per prompt x sampling), e.g.
`p512-r256-n4-stochastic`; the full grid has 2 x 3 x 2 x 2 = 24 cells. Each cell asks for
`logical_prompts x n` requests; `n` means n *independently repeated* requests per prompt (not a
group). Prompt `i` of length L is the first L ids of the token stream seeded by `prompt_seeds[i]`,
drawn uniformly from the regular vocabulary (special ids are never drawn); a workload with a
`prompt_source` (issue 42) takes token ids of held-out corpus text instead (study/real_prompts.py). A stochastic request
for (prompt i, sample j) carries `sample_seeds[i][j]`; greedy requests carry no seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from rollout_lib.study.arch import ARCHITECTURES
from rollout_lib.study.prereg import Preregistration, SamplingSpec
from rollout_lib.study.seeds import tensor_stream


@dataclass(frozen=True)
class GenerationRequest:
    """One independent generation request (the unit every backend serves)."""

    request_id: str
    prompt_index: int
    sample_index: int
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: str  # "greedy" | "stochastic"
    temperature: float
    top_p: float
    top_k: int | None
    seed: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def greedy(self) -> bool:
        return self.sampling == "greedy"


@dataclass(frozen=True)
class Cell:
    prompt_tokens: int
    response_tokens: int
    samples_per_prompt: int
    sampling: SamplingSpec

    @property
    def cell_id(self) -> str:
        return f"p{self.prompt_tokens}-r{self.response_tokens}-n{self.samples_per_prompt}-{self.sampling.name}"

    @property
    def pair_key(self) -> str:
        """Cells of different backends with the same key are paired for speedups."""
        return self.cell_id


class UnknownCellError(KeyError):
    def __init__(self, cell_id: str, known: list[str]):
        super().__init__(cell_id)
        self.cell_id = cell_id
        self.known = known

    def __str__(self) -> str:
        return f"unknown cell id {self.cell_id!r}; valid cell ids: {', '.join(self.known)}"


class Workload:
    """Deterministic view of the preregistered workload."""

    def __init__(self, study: Preregistration):
        self.study = study
        self.spec = study.workload
        self.arch = ARCHITECTURES[study.actor.architecture.name]

    def cells(self) -> list[Cell]:
        spec = self.spec
        return [Cell(p, r, n, s) for p in spec.prompt_tokens for r in spec.response_tokens
                for n in spec.samples_per_prompt for s in spec.samplings]

    def cell_ids(self) -> list[str]:
        return [c.cell_id for c in self.cells()]

    def cell(self, cell_id: str) -> Cell:
        for cell in self.cells():
            if cell.cell_id == cell_id:
                return cell
        raise UnknownCellError(cell_id, self.cell_ids())

    def select(self, cell_ids: list[str] | tuple[str, ...] | None) -> list[Cell]:
        """The cells named (all when None or empty), in grid order; unknown ids fail loudly."""
        if not cell_ids:
            return self.cells()
        for cell_id in cell_ids:
            self.cell(cell_id)
        wanted = set(cell_ids)
        return [c for c in self.cells() if c.cell_id in wanted]

    def prompt(self, prompt_index: int, length: int) -> tuple[int, ...]:
        if self.spec.prompt_source is not None:  # real text (rollout_lib/study/real_prompts.py)
            from rollout_lib.study.real_prompts import heldout_prompt

            return heldout_prompt(self.spec.prompt_source, self.spec.prompt_seeds[prompt_index], prompt_index,
                                  length, max(self.spec.prompt_tokens))
        return _prompt_tokens(self.spec.prompt_seeds[prompt_index], prompt_index, length,
                              max(self.spec.prompt_tokens), self.arch.first_special_id)

    def requests(self, cell: Cell, prompt_indices: list[int] | None = None) -> list[GenerationRequest]:
        """Requests of a cell, prompt-major (q0s0, q0s1, ..., q1s0, ...)."""
        indices = range(self.spec.logical_prompts) if prompt_indices is None else prompt_indices
        out = []
        for i in indices:
            for j in range(cell.samples_per_prompt):
                seed = self.spec.sample_seeds[i][j] if cell.sampling.seeded else None
                out.append(GenerationRequest(
                    request_id=f"{cell.cell_id}/q{i}s{j}", prompt_index=i, sample_index=j,
                    prompt_token_ids=self.prompt(i, cell.prompt_tokens),
                    max_new_tokens=cell.response_tokens, sampling=cell.sampling.name,
                    temperature=cell.sampling.temperature, top_p=cell.sampling.top_p,
                    top_k=cell.sampling.top_k, seed=seed,
                    eos_token_ids=(() if self.spec.stop_rule.ignore_eos else self.spec.stop_rule.eos_token_ids)))
        return out

    def partition_batches(self, cell: Cell, partition: tuple[int, ...]) -> list[list[GenerationRequest]]:
        """Split the cell's requests into batches by logical prompt: [2, 2] = prompts {0,1} and {2,3}."""
        if sum(partition) != self.spec.logical_prompts:
            raise ValueError(f"partition {list(partition)} does not cover {self.spec.logical_prompts} prompts")
        batches, start = [], 0
        for size in partition:
            batches.append(self.requests(cell, list(range(start, start + size))))
            start += size
        return batches


@cache
def _prompt_tokens(seed: int, prompt_index: int, length: int, max_length: int,
                   first_special_id: int) -> tuple[int, ...]:
    rng = tensor_stream(seed, f"prompt-{prompt_index}")
    stream = rng.integers(0, first_special_id, size=max_length, dtype="int64")
    return tuple(int(t) for t in stream[:length])
