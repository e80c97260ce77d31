"""What the tests of the engine-faithful runners share: every decode key the toy engines
capture (tests/engines/toy.py: a LoRA axis and an attention axis), dispatched by its labels,
replays what the model computes; an adoption's diff, counted from the runner's source; and a
graph recorded into vLLM's global pool outside the loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path


def check_every_key(gs, model, sizes: Iterable[int], *, exact: bool = True) -> None:
    """Each decode key of ``gs`` (a ``GraphSet``), by its labels, at each of ``sizes``, replays
    ``model.expected`` after the model's input is drawn again: bit for bit, or (``exact=False``,
    a GPU's kernels) within torch's float tolerance."""
    import torch

    model.x.normal_()
    for lora in ("lora", "nolora"):
        for att in ("a", "b"):
            labels = {"lora": lora, "attention": att}
            for n in sizes:
                (out,) = gs.replay(gs.variant("decode", **labels), n)
                want = model.expected("decode", n, labels)
                if exact:
                    assert torch.equal(out, want), (labels, n)
                else:
                    torch.testing.assert_close(out, want)


def check_adoption(adoption, runner: Path, most: tuple[int, int]) -> None:
    """The adoption of ``runner`` (a fake runner's file) adds and removes some lines and at most
    ``most`` (added, removed), as ``adoption.counted`` (tests/engines/adoption.py) counts them,
    checked against its markers read from the source (``# +`` lines added, ``# -`` removed);
    printed, for the test's log."""
    added, removed = adoption.counted(runner)
    source = runner.read_text()
    assert added == sum(1 for line in source.splitlines() if adoption.ADDED.search(line))
    assert removed == sum(1 for line in source.splitlines() if adoption.REMOVED.match(line))
    assert 0 < added <= most[0] and 0 < removed <= most[1], (added, removed)
    print(f"{runner.stem} adoption: +{added} -{removed}")


def speculator_graph(outside: list, tensor: Callable[[], object]) -> Callable:
    """A vLLM runner's ``configure`` hook: after the manager's capture, one graph recorded into
    vLLM's global pool outside the capture loop, as vLLM's speculator and encoder graphs are,
    allocating ``tensor()``; the tensor and the graph are appended to ``outside`` (which keeps
    them alive until the caller clears it)."""

    def configure(runner, streams) -> None:
        import torch

        from engines import vllm_runner

        capture = runner.manager.capture

        def capture_and_speculate(model, loop):
            capture(model, loop)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=vllm_runner.get_global_graph_pool()):
                outside.append(tensor())
            outside.append(g)

        runner.manager.capture = capture_and_speculate

    return configure
