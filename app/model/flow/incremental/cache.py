"""The incremental flow's encoder stages (app/model/flow/incremental/state.py): their committed length and conv
left context, and `StageCall`, one call's view of a stage's state, which the encoder pass (encode_batch.py)
reads and stages. Keys/values live in the stream's blocks of the pool (paged.py, encoder_rows.py); the
relative-position rows are one table for all streams (positions.py).
Design notes: docs/model.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class StageState:
    """Committed state of one encoder stage: `length` positions, and the conv tails at it. Its keys/values
    live in the stream's pool blocks (encoder_rows.py), addressed by the estimator stage's block table."""

    length: int = 0
    tails: list[list[Tensor]] = field(default_factory=list)  # [[one conv's [1, C, k-1] inputs before `length`]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.tails for t in slot)

    def share(self) -> StageState:
        return StageState(self.length, [list(slot) for slot in self.tails])  # tails are replaced, never written

    trimmed = share  # nothing past `length` is held here (the pool's `PagedStage.trimmed` gives blocks back)


class StageCall:
    """One call's view of a `StageState`: positions start..end-1 are new, start..commit-1 get committed. The
    encoder pass (encode_batch.py) reads the stage's one causal conv's committed inputs (`committed_tail`),
    stages the new ones (`stage_tail`) and writes keys/values at positions >= its length only; `finish()`
    commits, until then the state is unchanged."""

    def __init__(self, state: StageState, start: int, end: int, commit: int, host_rows: Tensor) -> None:
        """host_rows: long [end] on the host, the rows of the stage's pool tensor that hold this stream's positions
        0..end-1 (`encoder_rows.flat_rows` of its block table)."""
        assert state.length == start <= commit <= end, (state.length, start, commit, end)
        self.state, self.start, self.end, self.commit, self.host_rows = state, start, end, commit, host_rows
        self._tails = state.tails

    def committed_tail(self, zeros: Tensor) -> Tensor:
        """The conv's inputs at the positions before `start`: [1, C, k-1]; `zeros` at the sequence start."""
        return self.state.tails[0][0] if self.state.tails else zeros

    def stage_tail(self, new_tail: Tensor) -> None:
        """The conv's inputs at the positions before `commit`: [1, C, k-1]."""
        self._tails = [[new_tail]]

    def finish(self) -> None:
        """Commit: positions < `commit` and the conv tail at `commit` become the state."""
        self.state.tails = self._tails
        self.state.length = self.commit
