"""Small CaptureTargets for GPU tests (faulty on purpose), and the tests'
capture-and-verify-clean step."""

from __future__ import annotations

import torch

from capture_plan.executor.pool import raw_bytes

MiB = 2**20


class Synthetic:
    """decode: out = (x[:bs] * 2) + 1 over float32 rows of 256 KiB.

    The largest size also allocates and frees a 64 MiB temporary, so the pool
    has one big segment that later (smaller) captures reuse from its low end.
    ``oob=(bs, offset, nbytes)`` makes the graph at ``bs`` write ``nbytes`` at
    ``offset`` past its output's start: inside that segment, outside its blocks.
    ``fail=(bs, exc)`` raises ``exc`` while capturing/running ``bs``.
    """

    row = 64 * 1024  # floats per request: 256 KiB

    def __init__(self, max_bs: int = 16, oob=None, fail=None, moving=False):
        self.max_bs = max_bs
        self.x = torch.zeros(max_bs, self.row, device="cuda")
        self.oob, self.fail, self.moving = oob, fail, moving
        self.static = [torch.zeros(max_bs, self.row, device="cuda") for _ in range(2)]
        self.calls = 0

    def run(self, phase, bs, ws):
        self.calls += 1
        if self.fail and self.fail[0] == bs and torch.cuda.is_current_stream_capturing():
            raise self.fail[1]
        if self.moving:  # returns a different static buffer on every call
            buf = self.static[self.calls % 2][:bs]
            buf.copy_(self.x[:bs])
            return buf
        if bs == self.max_bs:
            big = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
            big.zero_()
            del big
        out = self.x[:bs] * 2 + 1
        if self.oob and self.oob[0] == bs:
            raw_bytes(out.data_ptr() + self.oob[1], self.oob[2], out.device).fill_(0x5A)
        return out

    def prepare(self, phase, n, bs, gen):
        self.x.normal_(generator=gen)

    def refresh(self, phase, n, bs, ws):
        pass


class Gated(Synthetic):
    """Synthetic whose capture at ``gate_bs`` blocks until ``gate`` is set:
    holds a background capture at a known point (the gate is waited on while
    recording, outside the executor's lock)."""

    def __init__(self, gate_bs: int, **kw):
        import threading

        super().__init__(**kw)
        self.gate_bs = gate_bs
        self.gate = threading.Event()
        self.reached = threading.Event()

    def run(self, phase, bs, ws):
        if bs == self.gate_bs and torch.cuda.is_current_stream_capturing():
            self.reached.set()
            if not self.gate.wait(60):
                raise TimeoutError("gate never opened")
        return super().run(phase, bs, ws)


def assert_verifies_clean(plan, target, **verify_kw) -> None:
    """Capture ``plan`` of ``target`` with the allocation history recorded (so
    every check of ``verify`` can run), ``verify(gs, **verify_kw)``, assert that
    it found no fault; the graphs are released either way."""
    from capture_plan.executor import capture, verify

    gs = capture(plan, target, progress=False, record=True)
    try:
        res = verify(gs, **verify_kw)
        assert res.ok, res.summary()
    finally:
        gs.release()


def prime_capture_stream(tmp_path, *, background: bool = False) -> None:
    """Capture and release one tiny graph, so that the executor's capture stream
    and its cuBLAS workspace exist before a test measures what is left over.

    The workspace is made once per (thread's cuBLAS handle, stream) and kept
    for the life of the process (capture_plan.executor.streams.capture_stream): it is the
    one allocation a capture leaves behind on purpose."""
    import torch

    from capture_plan.executor import capture
    from capture_plan.planner import BuildOptions, build_plan

    spec = tmp_path / "prime.toml"
    spec.write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1]\n')
    gs = capture(
        build_plan(BuildOptions(backend="torch", spec=spec, output=tmp_path / "prime.json")),
        Synthetic(max_bs=1),
        progress=False,
        background=background,
    )
    if background:
        assert gs.wait(60)
    gs.release()
    torch.cuda.synchronize()
