"""§4, "process outputs", for `n` > 1 (vLLM V1's parallel sampling): one prompt, n completions.
The scheduler sees n ordinary child requests (the same prompt; a seeded parent gives child i the
seed + i, as vLLM does); their outputs are gathered here under the parent's id. Child 0 computes
the prompt alone and the others join once its full blocks are in the prefix cache (§5), so the
prompt's blocks are computed once and shared instead of n times."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from nanoserve.engine.request import Request
from nanoserve.entrypoints.outputs import CompletionOutput, RequestOutput


@dataclass(eq=False)
class ParentRequest:
    request_id: str
    children: list[Request]
    held: list[Request]  # not yet scheduled: they wait for child 0's prompt
    done: dict[int, CompletionOutput] = field(default_factory=dict)  # index -> final output

    def index(self, child_id: str) -> int:
        return next(i for i, c in enumerate(self.children) if c.request_id == child_id)

    def release(self) -> list[Request]:
        """The held children, once child 0 has computed the prompt (or ended)."""
        first = self.children[0]
        if not self.held or not (first.num_output_tokens or first.is_finished):
            return []
        held, self.held = self.held, []
        return held

    def gather(self, output: RequestOutput, delta: bool) -> RequestOutput | None:
        """A child's output as the parent's: each DELTA at once; the final one only when every
        child has finished, with all n completions in index order."""
        completion = replace(output.outputs[0], index=self.index(output.request_id))
        if output.finished:
            self.done[completion.index] = completion
        finished = len(self.done) == len(self.children)
        if not delta and not finished:
            return None
        outputs = [completion] if delta else [self.done[i] for i in range(len(self.children))]
        return replace(output, request_id=self.request_id, outputs=outputs, finished=finished)
