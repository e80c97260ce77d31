"""A toy model both runners capture: on CUDA, or on the fake CUDA of tests/fake_cuda.py.

``forward(phase, bs, labels)`` is a whole forward at ``bs`` requests (its phase's
tokens per request): ``x[:rows] @ w``, plus a LoRA delta for ``lora="lora"``,
through a ReLU for ``attention="b"``, an output allocated as a model's are (in
the graph's pool while recording). ``piece(k, x)`` and ``attention(x)`` are
vLLM's piecewise split: compiled pieces, and attention run eagerly between
them. With ``fake`` (tests/fake_cuda.py's state) every computation made while
a graph records is also replayed by that graph.
"""

from __future__ import annotations

import torch


class ToyModel:
    def __init__(
        self, tokens: dict[str, int], *, max_tokens: int, hidden: int = 8, pieces: int = 3, device=None, fake=None
    ):
        self.tokens, self.hidden, self.fake = tokens, hidden, fake
        self.device = torch.device("cpu") if fake is not None else torch.device(device or "cuda")
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.x = torch.randn(max_tokens, hidden, generator=gen).to(self.device)
        self.w = torch.randn(hidden, hidden, generator=gen).div_(hidden**0.5).to(self.device)
        self.lora = torch.randn(hidden, hidden, generator=gen).div_(hidden).to(self.device)
        self.wp = [torch.randn(hidden, hidden, generator=gen).div_(hidden**0.5).to(self.device) for _ in range(pieces)]

    # -- how the model's code allocates and runs ------------------------------
    def new(self, rows: int) -> torch.Tensor:
        """An output tensor: in the recording graph's pool, else the ordinary allocator."""
        if self.fake is None:
            return torch.empty(rows, self.hidden, device=self.device)
        return (
            self.fake.pool_tensor(rows, self.hidden)
            if self.fake.recording is not None
            else self.fake.alloc(rows, self.hidden)
        )

    def launch(self, fn) -> None:
        """Run ``fn``'s kernels now (on the fake: also on every replay of the graph recording them)."""
        fn()
        if self.fake is not None and self.fake.recording is not None:
            self.fake.recording.calls.append(fn)

    # -- a whole forward (SGLang's decode runners, vLLM's FULL graphs) -------------
    def forward(self, phase: str, bs: int, labels=None) -> torch.Tensor:
        labels = labels or {}
        rows = bs * self.tokens[phase]
        out = self.new(rows)
        x, w, lora = self.x, self.w, self.lora
        use_lora, relu = labels.get("lora") == "lora", labels.get("attention") == "b"

        def compute():
            torch.mm(x[:rows], w, out=out)
            if use_lora:
                out.add_(x[:rows] @ lora)
            if relu:
                out.relu_()

        self.launch(compute)
        return out

    def expected(self, phase: str, rows: int, labels=None) -> torch.Tensor:
        """What ``forward`` computes for the first ``rows`` rows (the tests' reference)."""
        labels = labels or {}
        out = self.x[:rows] @ self.w
        if labels.get("lora") == "lora":
            out = out + self.x[:rows] @ self.lora
        return out.relu() if labels.get("attention") == "b" else out

    # -- vLLM's piecewise split ------------------------------------------------------
    def piece(self, k: int, x: torch.Tensor) -> torch.Tensor:
        out = self.new(x.shape[0])
        wk = self.wp[k]
        self.launch(lambda: torch.mm(x, wk, out=out))
        return out

    def attention(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``tanh(x)`` into ``out``: eagerly between pieces, inside a FULL graph's recording."""
        self.launch(lambda: torch.tanh(x, out=out))

    def expected_pieces(self, rows: int) -> torch.Tensor:
        h = self.x[:rows]
        for k, wk in enumerate(self.wp):
            h = h @ wk
            if k < len(self.wp) - 1:
                h = torch.tanh(h)
        return h

    def on_after_cuda_graph_warmup(self) -> None:
        """SGLang's attention-backend hook after each warm-up run (counted)."""
        self.after_warmup = getattr(self, "after_warmup", 0) + 1

    def prepare(self, phase, n, bs, generator) -> None:
        """Fresh inputs for verify."""
        self.x.normal_(generator=generator)
