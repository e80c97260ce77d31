"""tests/engines/engine_layers.py (the runners' profiling forward: vLLM's and SGLang's eager
decoder layers over a transformers model's weights) allocates what fit counts for the layer
phase (planner/fit/estimate.py ``activation_per_token``): the peak of the bytes its tensors
hold, traced on the CPU op by op, against fit's bytes a token x the tokens, for each
architecture the bench runs and both engines' code. The stand-in and fit come from one
reading of the engines' code (the lines each names); this holds them to each other, op by
op, where the GPU bench holds them to each other by the allocator's peak. The same trace, as
an ordered list of requests, holds planner/fit/reserve.py's simulated sizing step to the
stand-in's order of allocations and frees (the torch reserve growth it simulates depends on
that order, not only on the peak)."""

from __future__ import annotations

import json
import weakref
from functools import partial

import pytest

from bench_modules import bench_module


def _tracer():
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from capture_plan.planner.memory.allocator import FREE

    class Trace(TorchDispatchMode):
        """The storages made under it in order, as PoolSim.run's requests: ``(bytes, id)``
        where an op makes one, ``(FREE, id)`` before the next op once no tensor made under it
        holds it (so an address the allocator hands on is a new storage); the ids of boolean
        ones in ``masks`` (the stand-in's expert masks: the engine's fused kernel makes none)."""

        def __init__(self, before=()):
            super().__init__()
            #: storages made before it (a view of one is not a new one): not counted
            self.before = {t.untyped_storage().data_ptr() for t in before}
            self.live: dict[int, tuple[int, list]] = {}
            self.ops: list[tuple[int, int]] = []
            self.masks: set[int] = set()

        def sweep(self):
            for ptr, (i, refs) in list(self.live.items()):
                if not any(r() is not None for r in refs):
                    self.ops.append((FREE, i))
                    del self.live[ptr]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.sweep()  # what died since the last op dies before this one allocates
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    s = t.untyped_storage()
                    if s.data_ptr() in self.before:
                        continue
                    if s.data_ptr() not in self.live:
                        self.live[s.data_ptr()] = (len(self.ops), [])
                        if t.dtype == torch.bool:
                            self.masks.add(len(self.ops))
                        self.ops.append((s.nbytes(), len(self.ops)))
                    self.live[s.data_ptr()][1].append(weakref.ref(t))
            return out

        @property
        def peak(self) -> int:
            """The most bytes the storages held at once."""
            size = {i: b for b, i in self.ops if b != FREE}
            held = top = 0
            for b, i in self.ops:
                held += -size[i] if b == FREE else b
                top = max(top, held)
            return top

    return torch, Trace


def _case(name: str, tmp_path, dtype: str, tokens: int, engine: str):
    """A small transformers model of the bench architecture ``name`` in ``dtype`` (3 layers,
    hidden 256), fit's reading of its config, ``tokens`` ids, and the workspace its MoE layers
    write (vLLM's kept one, made here, for ``engine`` "vllm"; SGLang's per call); with the
    tensors made before the forward (not the forward's)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from capture_plan.planner.fit.model import load_model
    from capture_plan.tests.engines import engine_layers
    from capture_plan.tests.engines.case_model import fused_moe_workspace_bytes, moe_dims

    cfg = bench_module("harness").hf_config(
        name, num_hidden_layers=3, hidden_size=256, intermediate_size=1024, num_attention_heads=4
    )
    cfg.num_key_value_heads, cfg.head_dim, cfg.dtype = 2, 64, dtype
    if name == "qwen2_moe":
        cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size = 256, 1024
    if name == "mixtral":
        cfg.intermediate_size = 256  # the experts' (Mixtral's intermediate_size is theirs)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval().to(getattr(torch, dtype))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    m = load_model(str(tmp_path / "config.json"))
    ids = torch.randint(0, 100, (tokens,))
    held = None
    if engine == "vllm" and moe_dims(hf.config) is not None:  # the workspace vLLM's manager keeps
        top_k, inter, hidden, _ = moe_dims(hf.config)
        elem = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        held = torch.empty(fused_moe_workspace_bytes(tokens, top_k, inter, hidden, elem), dtype=torch.uint8)
    before = [ids, *hf.parameters(), *hf.buffers(), *([held] if held is not None else [])]
    return hf, m, ids, engine_layers.Workspace(held), before


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "mixtral", "qwen2_moe"])
def test_the_profiling_forward_holds_at_its_peak_what_fit_counts(name, engine, tmp_path):
    torch, Trace = _tracer()
    from capture_plan.planner.fit import estimate
    from capture_plan.tests.engines import engine_layers

    tokens = 4096  # the stand-ins' 64-row chunks and the norms' (tokens x 1) are under 2% of it
    hf, m, ids, workspace, before = _case(name, tmp_path, "float32", tokens, engine)
    with torch.no_grad(), Trace(before) as peak:
        out = engine_layers.profile_forward(hf, ids, workspace, engine)
        del out
    fit = tokens * estimate.activation_per_token(m, 1, engine)
    assert fit <= peak.peak <= fit * 1.02, (peak.peak, fit)


def _per_token(ops: list[tuple[int, int]], tokens: int, masks: set[int] = frozenset()) -> list[tuple]:
    """``ops``' tensors of a whole number of bytes a token (the stand-ins' row chunks and
    weight-sized temporaries are not: ``tokens`` is prime to them), but ``masks``, as (bytes a
    token, the earlier such tensors, by their order, freed since the last one), and what is
    left to free at the end."""
    from capture_plan.planner.memory.allocator import FREE

    kept = (i for b, i in ops if b != FREE and b and b % tokens == 0 and i not in masks)
    order = {i: k for k, i in enumerate(kept)}
    out, freed = [], []
    for b, i in ops:
        if i not in order:
            continue
        if b == FREE:
            freed.append(order[i])
        else:
            out.append((b // tokens, tuple(sorted(freed))))
            freed = []
    return [*out, ("end", tuple(sorted(freed)))]


def _reference_case(tmp_path, tokens: int):
    """The reference decode step's model (references/decode.py, bfloat16, one rank) at small
    dimensions, fit's reading of the same dimensions from a spec, ``tokens`` ids, and the
    tensors made before the forward."""
    torch = pytest.importorskip("torch")
    from capture_plan.planner.fit.model import load_model
    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model

    dims = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 1024, "vocab": 100}
    ref = ReferenceModel(ReferenceConfig(model=Model(**dims), max_bs=2, max_seqlen=8), backend="torch", device="cpu")
    spec = tmp_path / "reference.toml"
    table = "".join(f"{k} = {v}\n" for k, v in dims.items())
    spec.write_text(f'[model]\n{table}\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1]\n')
    ids = torch.randint(0, 100, (tokens,))
    made = [t for d in [*ref.layers, ref.__dict__] for t in d.values() if isinstance(t, torch.Tensor)]
    return ref, load_model(str(spec)), ids, [ids, *made]


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "mixtral", "qwen2_moe", "reference"])
def test_the_sizing_steps_layers_allocate_in_the_order_fit_simulates(name, tmp_path):
    """planner/fit/reserve.py simulates torch's reserve over vLLM 0.34.0's sizing step from the
    order of its requests, not their peak: the stand-in's forward (vLLM's code, or the
    reference decode step's layers as vLLM's), traced op by op in the model's dtype, allocates
    and frees its per-token tensors in the order the simulation's layers do, each of the size
    it gives (the MoE layers' caches in the kept workspace, as both take them)."""
    torch, Trace = _tracer()
    from capture_plan.planner.fit.reserve import sizing_step_requests
    from capture_plan.planner.fit.tables import sampler_rule
    from capture_plan.tests.engines import engine_layers

    tokens = 4099  # prime: no 64-row chunk or weight-sized temporary is a whole number of bytes a token
    if name == "reference":
        ref, m, ids, before = _reference_case(tmp_path, tokens)
        forward = partial(engine_layers.reference_forward, ref, ids)
    else:
        hf, m, ids, workspace, before = _case(name, tmp_path, "bfloat16", tokens, "vllm")
        forward = partial(engine_layers.profile_forward, hf, ids, workspace, "vllm")
    with torch.no_grad(), Trace(before) as seq:
        out = forward()
        del out
        seq.sweep()
    # the step's layers alone: no sampled rows, so the sampler's requests are of 0 bytes
    simulated = sizing_step_requests(m, 1, tokens, 0, sampler_rule("vllm", "0.34.0").rule)
    assert _per_token(seq.ops, tokens, seq.masks) == _per_token(simulated, tokens)


def test_an_eagle_heads_dummy_propose_holds_at_its_peak_what_fit_counts(tmp_path):
    """The fit bench's EAGLE head (tests/engines/case_model.py route_vllm_eagle, vLLM's eager
    layers in the profiling run's dummy propose: engine_layers.eagle_forward) over all the run's
    tokens while the target's hidden states are held, traced on the CPU op by op, against
    planner/fit/estimate.py eagle_profile_peak for the same dimensions."""
    torch, Trace = _tracer()
    import msgspec

    from capture_plan.planner.fit import estimate
    from capture_plan.planner.fit.model import load_model
    from capture_plan.references.speculative import SpeculativeConfig, SpeculativeModel
    from capture_plan.schemas.spec import Model
    from capture_plan.tests.engines.case_model import as_vllm_eagle, route_vllm_eagle

    dims = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 1024, "vocab": 100}
    target = SpeculativeModel(
        SpeculativeConfig(model=Model(**dims), max_bs=512, max_seqlen=16), backend="torch", device="cpu"
    )
    as_vllm_eagle(target)

    class Speculator:  # what the route sets on the runner's speculator
        pass

    spec, reqs, tokens = Speculator(), 512, 4096
    route_vllm_eagle(spec, target, tokens, reqs, 2, 4096)
    made = [t for m in (target.target, target.draft) for d in [*m.layers, m.__dict__] for t in d.values()]
    before = [t for t in [*made, *target.__dict__.values(), *spec.state] if isinstance(t, torch.Tensor)]
    with torch.no_grad(), Trace(before) as peak:
        held = torch.zeros(tokens, dims["hidden"], dtype=torch.bfloat16)  # the target's hidden states
        spec._forward(reqs, tokens, None, skip_attn=True)
        del held
    (tmp_path / "t.toml").write_text(
        "[model]\n" + "".join(f"{k} = {v}\n" for k, v in dims.items()) + '\n[[phases]]\nname = "decode"\n'
        'kind = "decode"\nsizes = [1]\n'
    )
    m = load_model(str(tmp_path / "t.toml"))
    fit = estimate.eagle_profile_peak(msgspec.structs.replace(m, layers=1), m, 1, tokens, reqs, 4096)
    assert fit <= peak.peak <= fit * 1.02, (peak.peak, fit)
