"""The expert MLP's planned step (megatron_tma.mlp_function: the module's checks once, fc1 + activation as one node,
fc2) against the composed public entries (`GroupedFP8MLP.planned_step = False`): the same bits for the output, the
input, probs and weight gradients and `main_grad` accumulation, over the module's options; what fc1's backward frees
before its GEMMs (less than the composed call holds); and which calls take the composed path. On the CPU the
ops' reference kernels run (the device's kernel, as on a GPU); tests/test_mlp_gpu.py runs the same comparison on the
CUDA kernels. Each comparison is `torch.equal` (NaN-free inputs)."""
import pytest
import torch

from megatron_tma import mlp as mlp_module
from megatron_tma.groups import make_group_sizes
from megatron_tma.mlp import GroupedFP8MLP
from megatron_tma.permutation import permutation_from_routing_map

G, H, F, T = 4, 256, 128, 300


def _pair(**kw):
    torch.manual_seed(0)
    one = GroupedFP8MLP(G, H, F, kw.pop("activation", "swiglu"), **kw)
    composed = GroupedFP8MLP(G, H, F, one.activation, **kw)
    composed.load_state_dict(one.state_dict())
    composed.planned_step = False
    return one, composed


def _inputs(dist="paper", t=T, probs_dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    sizes = make_group_sizes(t, G, dist, seed)
    x = torch.randn(t, H, generator=gen).bfloat16()
    probs = torch.rand(t, generator=gen).to(probs_dtype)
    dy = torch.randn(t, H, generator=gen).bfloat16()
    return x, sizes, probs, dy


def _step(module, x, sizes, probs, dy, x_grad=True, probs_grad=True, permutation=None, main_grad=None):
    """Forward + backward on fresh leaves: [out, x.grad, probs.grad, then each weight's .grad or main_grad]."""
    x = x.clone().requires_grad_(x_grad)
    probs = None if probs is None else probs.clone().requires_grad_(probs_grad)
    for w in module.parameters():
        w.grad = None
        if main_grad is not None:
            w.main_grad = torch.full(w.shape, 0.5, dtype=main_grad)
    out, _ = module(x, sizes, probs, permutation)
    out.backward(dy)
    grads = [w.main_grad if main_grad is not None else w.grad for w in module.parameters()]
    return [out.detach(), x.grad, None if probs is None else probs.grad] + grads


def _assert_same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert (u is None) == (v is None), f"result {i}: {u is None} vs {v is None}"
        if u is not None:
            assert u.dtype == v.dtype and torch.equal(u, v), f"result {i} differs"


def _counting_planned_calls(monkeypatch):
    """Counts the planned step's calls, so a test knows which path ran."""
    calls = []
    real = mlp_module.fp8_expert_mlp
    monkeypatch.setattr(mlp_module, "fp8_expert_mlp", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu", "squared_relu"])
@pytest.mark.parametrize("dist", ["paper", "with_empty", "one_group"])
def test_same_bits_as_the_composed_functions(activation, dist, monkeypatch):
    calls = _counting_planned_calls(monkeypatch)
    one, composed = _pair(activation=activation)
    inputs = _inputs(dist)
    _assert_same(_step(one, *inputs), _step(composed, *inputs))
    assert len(calls) == 1  # the planned step ran for `one` only


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("main_grad", [torch.float32, torch.bfloat16])
def test_main_grad_accumulation_is_the_same(layout, main_grad):
    one, composed = _pair(weight_layout=layout)
    inputs = _inputs()
    _assert_same(_step(one, *inputs, main_grad=main_grad), _step(composed, *inputs, main_grad=main_grad))


@pytest.mark.parametrize("x_grad,probs_grad,frozen", [(False, True, None), (True, False, None), (False, False, "fc1"),
                                                      (True, True, "fc2"), (False, True, "both"), (True, True, "both")])
def test_partial_gradients_are_the_same(x_grad, probs_grad, frozen):
    one, composed = _pair()
    for m in (one, composed):
        for name in (("linear_fc1", "linear_fc2") if frozen == "both" else (f"linear_{frozen}",) if frozen else ()):
            getattr(m, name).weight.requires_grad_(False)
    inputs = _inputs()
    _assert_same(_step(one, *inputs, x_grad=x_grad, probs_grad=probs_grad),
                 _step(composed, *inputs, x_grad=x_grad, probs_grad=probs_grad))


@pytest.mark.parametrize("probs", ["fp32", "bf16", "none"])
def test_probs_forms_are_the_same(probs):
    one, composed = _pair()
    x, sizes, p, dy = _inputs(probs_dtype=torch.bfloat16 if probs == "bf16" else torch.float32)
    p = None if probs == "none" else p
    _assert_same(_step(one, x, sizes, p, dy), _step(composed, x, sizes, p, dy))


@pytest.mark.parametrize("options", [{"keep_transposed_weight": False}, {"pow2_scales": True}, {"pad_to": 16},
                                     {"pad_to": 128}])
def test_module_options_are_the_same(options):
    one, composed = _pair(**options)
    inputs = _inputs()
    _assert_same(_step(one, *inputs), _step(composed, *inputs))


def _routed_inputs(tokens=120, topk=3):
    """(permutation, sizes, probs, x, dy) of `tokens` tokens routed top-`topk` over the G experts."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(tokens, G, generator=gen)
    routing = torch.zeros(tokens, G, dtype=torch.bool).scatter_(1, scores.topk(topk, dim=1).indices, True)
    permutation, sizes, probs = permutation_from_routing_map(routing, topk, torch.rand(tokens, G, generator=gen))
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    dy = torch.randn(tokens, H, generator=gen).bfloat16()
    return permutation, sizes, probs, x, dy


def test_permutation_in_experts_is_the_same():
    permutation, sizes, probs, x, dy = _routed_inputs()
    one, composed = _pair()
    _assert_same(_step(one, x, sizes, probs, dy, permutation=permutation),
                 _step(composed, x, sizes, probs, dy, permutation=permutation))


def test_deferred_weight_gradients_are_the_same():
    one, composed = _pair(defer_wgrad=True)
    x, sizes, probs, dy = _inputs()
    results = []
    for m in (one, composed):
        for w in m.parameters():
            w.main_grad = torch.zeros(w.shape)
        outs = []
        for micro_batch in range(3):  # three backwards pending, then one flush
            xi = (x * (micro_batch + 1)).requires_grad_()
            out, _ = m(xi, sizes, probs)
            out.backward(dy)
            outs += [out.detach(), xi.grad]
        assert m.flush_wgrad() == 3
        results.append(outs + [w.main_grad for w in m.parameters()])
    _assert_same(*results)


def test_inference_is_the_same_and_keeps_nothing(monkeypatch):
    calls = _counting_planned_calls(monkeypatch)
    one, composed = _pair()
    x, sizes, probs, _ = _inputs()
    with torch.no_grad():
        a, b = one(x, sizes, probs)[0], composed(x, sizes, probs)[0]
    assert torch.equal(a, b) and not a.requires_grad and len(calls) == 1


def test_hooks_recompute_and_planned_step_off_take_the_composed_path(monkeypatch):
    calls = _counting_planned_calls(monkeypatch)
    x, sizes, probs, dy = _inputs()
    one, _ = _pair()
    seen = []
    handle = one.linear_fc2.register_forward_pre_hook(lambda module, args: seen.append(module))
    _step(one, x, sizes, probs, dy)
    assert seen == [one.linear_fc2] and not calls  # the hook ran: the linears were called as modules
    handle.remove()
    _step(one, x, sizes, probs, dy)
    assert len(calls) == 1
    recompute, _ = _pair(recompute_activation=True)
    _step(recompute, x, sizes, probs, dy)
    assert len(calls) == 1


def test_a_weight_of_another_dtype_gets_the_composed_paths_error():
    one, _ = _pair()
    one.linear_fc1.weight.data = one.linear_fc1.weight.data.float()
    x, sizes, probs, dy = _inputs()
    with pytest.raises(TypeError, match="weight must have dtype bfloat16"):
        _step(one, x, sizes, probs, dy)


def _alive_at_fc1s_gemms(module, monkeypatch, permute=False):
    """One forward + backward of `module`, watching which tensors are alive when fc1's backward GEMMs start:
    {"wgrad": (h, dh's BF16, z's FP8 columns), "dgrad": (dh's BF16, x's FP8 columns)}, True where alive."""
    import weakref

    from megatron_tma import activation, gemm, linear_activation, quant

    x, sizes, probs, dy = _inputs()
    x, probs = x.requires_grad_(), probs.requires_grad_()
    permutation = None
    if permute:
        permutation, sizes, probs, x, dy = _routed_inputs()
        x, probs = x.requires_grad_(), probs.requires_grad_()
    refs, alive, k_calls, columns = {}, {}, [], []
    real_m, real_k = gemm.run_m_grouped, gemm.run_k_grouped
    real_q = {n: getattr(quant, n) for n in ("run_1x128_and_grouped_128x1", "run_gather_1x128_and_grouped_128x1")}
    real_act = activation.act_times_probs_backward

    def is_alive(*names):
        return tuple(refs[n]() is not None for n in names)

    def m_grouped(*args, **kw):
        if k_calls == [1, 1] and "dgrad" not in alive:  # (fc2's, fc1's weight gradients done): fc1's dgrad
            alive["dgrad"] = is_alive("dh", "xt")
        out = real_m(*args, **kw)
        refs.setdefault("h", weakref.ref(out))  # the forward's first GEMM makes h
        return out

    def k_grouped(*args, **kw):
        k_calls.append(1)
        if len(k_calls) == 2:  # fc1's weight gradient
            alive["wgrad"] = is_alive("h", "dh", "zt")
        return real_k(*args, **kw)

    def quantizer(name):
        def run(*args, **kw):  # the forward's first call quantizes x, its second z (both with their columns)
            out = real_q[name](*args, **kw)
            columns.append(weakref.ref(out[2]))
            refs.update(zip(("xt", "zt"), columns))
            return out
        return run

    def act_backward(*args, **kw):
        dh, dprobs = real_act(*args, **kw)
        refs["dh"] = weakref.ref(dh)
        return dh, dprobs

    monkeypatch.setattr(gemm, "run_m_grouped", m_grouped)
    monkeypatch.setattr(gemm, "run_k_grouped", k_grouped)
    for name in real_q:
        monkeypatch.setattr(quant, name, quantizer(name))
    monkeypatch.setattr(activation, "act_times_probs_backward", act_backward)
    monkeypatch.setattr(linear_activation, "act_times_probs_backward", act_backward)
    out, _ = module(x, sizes, probs, permutation)
    out.backward(dy)
    return alive


@pytest.mark.parametrize("permute", [False, True])
def test_fc1s_backward_frees_dh_h_and_x_columns_before_its_gemms(monkeypatch, permute):
    """The planned step's fc1 + activation node (megatron_tma.linear_activation): at fc1's weight-gradient GEMM, h,
    dh's BF16 copy (quantized already) and fc2's saved z columns are gone; at fc1's dgrad GEMM x's columns are gone
    too. The composed call's two nodes keep dh (autograd hands it to fc1's node) and x's columns (saved) through
    both GEMMs: what the planned step's lower peak comes from. Same bits: test_same_bits_as_the_composed_functions."""
    one, composed = _pair()
    assert _alive_at_fc1s_gemms(one, monkeypatch, permute) == {"wgrad": (False, False, False),
                                                                "dgrad": (False, False)}
    monkeypatch.undo()
    assert _alive_at_fc1s_gemms(composed, monkeypatch, permute) == {"wgrad": (False, True, False),
                                                                     "dgrad": (True, True)}


def test_a_second_backward_through_the_planned_step_is_refused():
    """The fc1 + activation node frees h and x's columns in its backward: backward through it again (retain_graph)
    is refused with a message, not an AttributeError or a wrong gradient."""
    one, _ = _pair()
    x, sizes, probs, dy = _inputs()
    out, _ = one(x.requires_grad_(), sizes, probs)
    out.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated through once"):
        out.backward(dy)


def test_twice_differentiating_is_refused():
    one, _ = _pair()
    x, sizes, probs, dy = _inputs()
    x = x.requires_grad_()
    out, _ = one(x, sizes, probs)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.autograd.grad(out, x, dy, create_graph=True)


@pytest.mark.parametrize("permute", [False, True])
def test_no_tokens_is_the_same(permute):
    """T = 0: an empty output and empty gradients from both paths, the weights' gradients zero (main_grad unchanged)."""
    one, composed = _pair()
    x = torch.empty(0, H, dtype=torch.bfloat16)
    sizes = torch.zeros(G, dtype=torch.int64)
    probs, dy = torch.empty(0), torch.empty(0, H, dtype=torch.bfloat16)
    permutation = None
    if permute:
        permutation, sizes, probs = permutation_from_routing_map(torch.zeros(0, G, dtype=torch.bool), 2,
                                                                 torch.empty(0, G))
    _assert_same(_step(one, x, sizes, probs, dy, permutation=permutation),
                 _step(composed, x, sizes, probs, dy, permutation=permutation))
    _assert_same(_step(one, x, sizes, probs, dy, permutation=permutation, main_grad=torch.float32),
                 _step(composed, x, sizes, probs, dy, permutation=permutation, main_grad=torch.float32))


def test_under_saved_tensor_hooks_the_hooks_see_h_and_x_columns(monkeypatch):
    """Under `saved_tensors_hooks` (activation offloading) the planned step saves h and x's FP8 columns the usual way,
    so the hooks see them (the fc1 + activation node would hold them out of the hooks' sight), and the bits stay."""
    from megatron_tma import gemm, quant

    one, composed = _pair()
    x, sizes, probs, dy = _inputs()
    h_seen, saved = [], set()
    real_m = gemm.run_m_grouped
    monkeypatch.setattr(gemm, "run_m_grouped", lambda *a, **k: h_seen.append(real_m(*a, **k)) or h_seen[-1])

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    columns = []
    real_q = quant.run_1x128_and_grouped_128x1
    monkeypatch.setattr(quant, "run_1x128_and_grouped_128x1", lambda *a, **k: columns.append(real_q(*a, **k))
                        or columns[-1])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        planned = _step(one, x, sizes, probs, dy)
    assert h_seen[0].untyped_storage().data_ptr() in saved  # h, the forward's first GEMM's output
    assert columns[0][2].untyped_storage().data_ptr() in saved  # x's FP8 columns (its quantizer's first call)
    monkeypatch.undo()
    _assert_same(planned, _step(composed, x, sizes, probs, dy))


def test_autograd_grad_for_a_leaf_x_or_the_weights_runs_fc1():
    """`torch.autograd.grad` for a leaf x, or for the weights, runs fc1's GEMMs: the same gradients as the composed
    call (the engine's query refuses leaves among autograd.grad's inputs; those are wanted)."""
    one, composed = _pair()
    x, sizes, probs, dy = _inputs()
    for which in ("x", "weights"):
        grads = []
        for module in (one, composed):
            leaf, p = x.clone().requires_grad_(), probs.clone().requires_grad_()
            out, _ = module(leaf, sizes, p)
            wanted = [leaf] if which == "x" else list(module.linear_fc1.parameters())
            grads.append(torch.autograd.grad(out, wanted, dy))
        assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("defer", [False, True])
def test_a_backward_for_the_probs_alone_leaves_fc1_alone(defer):
    """`torch.autograd.grad(out, [probs])` never reached fc1's node in the composed call; the fc1 + activation node
    must not run fc1's GEMMs then either: the probs' gradient the same bits, fc1's `main_grad` untouched and nothing
    left in its wgrad deferral (fails if the node runs fc1's backward whenever it runs)."""
    one, composed = _pair(defer_wgrad=defer)
    x, sizes, probs, dy = _inputs()
    grads = []
    for module in (one, composed):
        for w in module.parameters():
            w.main_grad = torch.full(w.shape, 0.5)
        p = probs.clone().requires_grad_()
        out, _ = module(x.clone().requires_grad_(), sizes, p)
        grads.append(torch.autograd.grad(out, [p], dy)[0])
        assert all(torch.equal(w.main_grad, torch.full(w.shape, 0.5)) for w in module.linear_fc1.parameters())
        if defer:
            assert len(module.linear_fc1.wgrad_deferral) == 0
    assert torch.equal(*grads)
