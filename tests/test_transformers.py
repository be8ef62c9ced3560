"""transformers integration: tiny random-init Llama (grouped-query attention), Qwen2 (sliding
window), Gemma2 (softcap, alternating window) and BERT (bidirectional, padding) models built
from configs, run with our attention and with transformers' own, checked against a float64
run with DESIGN.md's rule (logits, loss, every parameter's gradient), greedy generation on a
left-padded batch with dynamic and static caches, torch.compile(fullgraph=True), dropout."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashattn_ext.transformers as fx  # noqa: E402
from flashattn_ext._measure import REL_ATOL, REL_ATOL_GRAD  # noqa: E402
from flashattn_ext.ops import dropout_mask, new_rng_state  # noqa: E402

from feature_reference import attention_ref, visible as feature_visible  # noqa: E402
from reference import BOTTOM_RIGHT, NONE, assert_accurate  # noqa: E402

NAME = fx.register()
REFERENCE = "reference_math"


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                         is_causal=None, **kwargs):
    """Plain-torch attention on transformers' full boolean mask (rows that see no key give 0;
    transformers' eager attention gives NaN there in float64, which then reaches every row)."""
    if attention_mask is None:
        causal = (is_causal if is_causal is not None else module.is_causal) and query.shape[2] > 1
        bias = None
    else:
        causal, bias = False, attention_mask
    out, _ = attention_ref(query, key, value, scaling, BOTTOM_RIGHT if causal else NONE, bias=bias,
                           softcap=float(softcap or 0.0))
    return out.transpose(1, 2).contiguous(), None


def _reference_mask(*args, **kwargs):
    return transformers.masking_utils.sdpa_mask(*args, **dict(kwargs, allow_is_causal_skip=False))


transformers.AttentionInterface.register(REFERENCE, _reference_attention)
transformers.masking_utils.AttentionMaskInterface.register(REFERENCE, _reference_mask)
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)


def _config(kind):
    if kind == "llama":
        return transformers.LlamaConfig(**SMALL)
    if kind == "qwen2":  # layer 0 full attention, layer 1 a window of 4 tokens
        return transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    if kind == "gemma2":  # softcap small enough to bite; layers alternate window / full; untied embeddings
        return transformers.Gemma2Config(**SMALL, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                         tie_word_embeddings=False)  # (tied, greedy decoding repeats one token)
    if kind == "t5":  # learned relative position bias (position_bias), encoder-decoder
        return transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                     relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0)
    return transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


_MODEL_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "bert": "BertForMaskedLM", "t5": "T5ForConditionalGeneration"}


def _model(kind, implementation, device, dtype=torch.float32):
    torch.manual_seed(0)  # the same weights for every implementation
    cls = getattr(transformers, _MODEL_CLASS[kind])
    return cls._from_config(_config(kind), attn_implementation=implementation).to(device, dtype).eval()


def _same_dtype_implementation(kind):
    return "eager" if kind == "gemma2" else "sdpa"  # transformers' sdpa refuses softcap


def _padded_batch(kind, device, length=14):
    """Token ids, the 2-D padding mask (left padding for decoders, right padding for BERT)
    and labels that ignore the padding."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (3, length), generator=g)
    mask = torch.ones(3, length, dtype=torch.long)
    pads = [(1, length // 4), (2, length // 2 + 1)]
    for row, n in pads:
        if kind in ("bert", "t5"):
            mask[row, length - n:] = 0
        else:
            mask[row, :n] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids.to(device), mask.to(device), labels.to(device)


def _run(model, ids, mask, labels):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    keep = mask.bool()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach()[keep], out.loss.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "bert", "t5"])
def test_logits_loss_and_gradients(device, kind, dtype, monkeypatch):
    """DESIGN.md's rule with transformers' own attention in the same dtype as "torch". The
    atol is relative to max(max|ref|, 0.1): values here are ~0.1, not ~1, and some gradients
    are exactly zero (a key bias does not change the softmax) but carry rounding."""
    ids, mask, labels = _padded_batch(kind, device)
    # transformers' eager attention is the float64 reference where no row is fully masked (T5's
    # right padding): it adds T5's position bias, which the plain reference here does not.
    reference = "eager" if kind == "t5" else REFERENCE
    ref_logits, ref_loss, ref_grads = _run(_model(kind, reference, device, torch.float64), ids, mask, labels)
    same_logits, same_loss, same_grads = _run(_model(kind, _same_dtype_implementation(kind), device, dtype), ids,
                                              mask, labels)
    unpadded = []
    monkeypatch.setattr(fx, "flash_attn_varlen_func",
                        lambda *a, **k: unpadded.append(1) or flashattn_ext_varlen(*a, **k))
    logits, loss, grads = _run(_model(kind, NAME, device, dtype), ids, mask, labels)
    # One padded batch per layer through the variable-length path; T5's position bias takes the
    # dense path with the padding folded into the bias.
    assert len(unpadded) == (0 if kind == "t5" else 2)
    assert_accurate("logits", logits, ref_logits, same_logits, REL_ATOL[dtype], atol_floor=0.1)
    assert_accurate("loss", loss, ref_loss, same_loss, REL_ATOL[dtype], atol_floor=0.1)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name, grad in grads.items():
        assert_accurate(name, grad, ref_grads[name], same_grads[name], REL_ATOL_GRAD[dtype], atol_floor=0.1)


def flashattn_ext_varlen(*args, **kwargs):
    from flashattn_ext import flash_attn_varlen_func
    return flash_attn_varlen_func(*args, **kwargs)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_greedy_generation_left_padded(device, kind, cache):
    ids, mask, _ = _padded_batch(kind, device, length=8)
    options = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0,
                   cache_implementation=cache, disable_compile=True)
    with torch.no_grad():
        theirs = _model(kind, _same_dtype_implementation(kind), device).generate(ids, **options)
        model = _model(kind, NAME, device)
        ours = model.generate(ids, **options)
        pads = int((mask[1] == 0).sum())
        alone = model.generate(ids[1:2, pads:], **dict(options, attention_mask=mask[1:2, pads:]))
    assert ours.shape == (3, 28) and len(set(ours[1, 8:].tolist())) > 5
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[1, 8:], alone[0, 8 - pads:])  # left padding changes nothing


def _count_calls(monkeypatch, *names):
    """Wraps the named functions of flashattn_ext.transformers to count their calls; returns
    the counts by name (the dict the wrappers update)."""
    calls = dict.fromkeys(names, 0)

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name in names:
        monkeypatch.setattr(fx, name, counted(name, getattr(fx, name)))
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_decode_steps_run_through_the_kvcache_function(device, kind, monkeypatch):
    """20 greedy tokens on a left-padded batch, dynamic cache: the prefill runs unpadded, every
    decode step through flash_attn_with_kvcache on transformers' cache (one call per layer and
    step). Each step's logits are checked with DESIGN.md's rule against a float64 prefill-only
    run (the whole prefix through the model without a cache, last position), with transformers'
    sdpa generate() as "torch"; the tokens are sdpa's and the float64 run's greedy choices."""
    ids, mask, _ = _padded_batch(kind, device, length=8)
    options = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0,
                   cache_implementation="dynamic", disable_compile=True, output_logits=True,
                   return_dict_in_generate=True)
    calls = _count_calls(monkeypatch, "flash_attn_with_kvcache", "flash_attn_varlen_func")
    with torch.no_grad():
        theirs = _model(kind, "sdpa", device).generate(ids, **options)
        ours = _model(kind, NAME, device).generate(ids, **options)
        layers = _config(kind).num_hidden_layers
        # 19 decode steps, one padded prefill
        assert calls == {"flash_attn_with_kvcache": 19 * layers, "flash_attn_varlen_func": layers}
        assert torch.equal(ours.sequences, theirs.sequences)
        reference = _model(kind, REFERENCE, device, torch.float64)
        for step, (logits, same) in enumerate(zip(ours.logits, theirs.logits)):
            prefix = ours.sequences[:, :8 + step]
            prefix_mask = torch.cat([mask, mask.new_ones(3, step)], 1)
            positions = (prefix_mask.cumsum(1) - 1).masked_fill(prefix_mask == 0, 1)
            ref = reference(input_ids=prefix, attention_mask=prefix_mask, position_ids=positions,
                            use_cache=False).logits[:, -1]
            assert torch.equal(ref.argmax(-1), ours.sequences[:, 8 + step])
            assert_accurate(f"step {step} logits", logits, ref, same, REL_ATOL[torch.float32], atol_floor=0.1)


def test_static_cache_generation_compiled(device):
    """generate() compiles the decode step for static caches (on CUDA by default; forced here
    on the CPU with a backend that needs no C++ compiler); the traced step reads the full mask."""
    ids, mask, _ = _padded_batch("llama", device, length=8)
    options = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0,
                   cache_implementation="static")
    compile_config = transformers.CompileConfig(fullgraph=True)
    if device == "cpu":
        compile_config = transformers.CompileConfig(fullgraph=True, backend="aot_eager")
        compile_config._compile_all_devices = True
    with torch.no_grad():
        theirs = _model("llama", "sdpa", device).generate(ids, disable_compile=True, **options)
        ours = _model("llama", NAME, device).generate(ids, compile_config=compile_config, **options)
    assert torch.equal(ours, theirs)


def test_packed_sequences_and_switching_implementation(device, monkeypatch):
    """Two sequences packed in one row (positions restart): from the positions alone
    transformers builds the full mask for that pattern; with the sequence boundaries
    (DataCollatorWithFlattening's return_flash_attn_kwargs) the row runs through the
    variable-length path. Each sequence's logits are those it gets alone. A model made with
    another implementation switches to ours with set_attn_implementation."""
    model = _model("llama", "sdpa", device)
    model.set_attn_implementation(NAME)
    assert model.config._attn_implementation == NAME
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(2)).to(device)
    positions = torch.tensor([list(range(5)) + list(range(7))], device=device)
    boundaries = dict(cu_seq_lens_q=torch.tensor([0, 5, 12], device=device), max_length_q=7)
    boundaries.update(cu_seq_lens_k=boundaries["cu_seq_lens_q"], max_length_k=7)
    unpadded = []
    monkeypatch.setattr(fx, "flash_attn_varlen_func",
                        lambda *a, **k: unpadded.append(1) or flashattn_ext_varlen(*a, **k))
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids[:, :5]).logits[0], model(input_ids=ids[:, 5:]).logits[0]])
        by_positions = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        assert not unpadded
        by_boundaries = model(input_ids=ids, position_ids=positions, use_cache=False, **boundaries).logits[0]
        assert len(unpadded) == 2
    torch.testing.assert_close(by_positions, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_boundaries, alone, rtol=1e-5, atol=1e-5)


def test_sdpa_models_run_ours_under_the_sdpa_mode(device):
    """transformers' own sdpa implementation, unmodified, inside flashattn_ext.sdpa.enabled():
    its F.scaled_dot_product_attention calls (4-D boolean masks, grouped-query heads) run
    our kernels, with transformers' results."""
    from flashattn_ext import sdpa
    ids, mask, labels = _padded_batch("llama", device)
    ref_logits, ref_loss, ref_grads = _run(_model("llama", REFERENCE, device, torch.float64), ids, mask, labels)
    model = _model("llama", "sdpa", device)
    same_logits, same_loss, same_grads = _run(model, ids, mask, labels)
    with sdpa.enabled(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits, loss, grads = _run(model, ids, mask, labels)
    names = {e.name for e in prof.events()}
    assert names & {"flashattn::fwd", "flashattn::_fwd", "flashattn::_fwd_plain"}
    assert names & {"flashattn::bwd", "flashattn::_bwd", "flashattn::_bwd_plain"}
    assert_accurate("logits", logits, ref_logits, same_logits, REL_ATOL[torch.float32], atol_floor=0.1)
    assert_accurate("loss", loss, ref_loss, same_loss, REL_ATOL[torch.float32], atol_floor=0.1)
    for name, grad in grads.items():
        assert_accurate(name, grad, ref_grads[name], same_grads[name], REL_ATOL_GRAD[torch.float32], atol_floor=0.1)


def test_compile_fullgraph_traces(device):
    """The traced path reads no mask values: the padding mask becomes a key-padding bias (the
    full-attention layer) or transformers' full mask (the sliding-window layer). Forward and
    backward trace; logits, loss and gradients are those of the eager run."""
    ids, mask, labels = _padded_batch("qwen2", device)
    model = _model("qwen2", NAME, device)
    logits, loss, grads = _run(model, ids, mask, labels)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    traced_logits, traced_loss, traced_grads = _run(compiled, ids, mask, labels)
    traced_grads = {name.removeprefix("_orig_mod."): g for name, g in traced_grads.items()}
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(traced_logits, logits, **close)
    torch.testing.assert_close(traced_loss, loss, **close)
    assert traced_grads.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(traced_grads[name], g, **close)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits, **close)


class _Attention(torch.nn.Module):
    is_causal = True


class _Encoder(torch.nn.Module):
    is_causal = False


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("padding", ["none", "left", "gap", "full_mask"])
def test_attention_paths_match_reference(device, padding, window, causal, monkeypatch):
    """Each path of the attention function (no mask; padding mask unpadded to the
    variable-length path; padding with a gap under a window, as a key-padding bias; a full
    mask; causal rows after cached keys as a decode step through flash_attn_with_kvcache)
    against plain attention on the same pattern, with softcap and grouped-query heads, 4
    queries after 7 cached keys (causal) or 4 queries on 11 keys (bidirectional, as an
    encoder's cross-attention: every query row runs)."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 4, 16, device=device, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 11, 16, device=device, dtype=torch.float64) for _ in range(2))
    keep = torch.ones(2, 11, dtype=torch.bool, device=device)
    if padding == "left":
        keep[1, :5] = False
    elif padding in ("gap", "full_mask"):
        keep[1, 3:6] = False
    if causal:
        pattern = feature_visible(4, 11, BOTTOM_RIGHT, (-1 if window is None else window - 1, -1), device)
    else:
        pattern = feature_visible(4, 11, NONE, (-1, -1) if window is None else (window, window), device)
    visible = keep[:, None, None, :] & pattern
    mask = {"none": None, "left": keep, "gap": keep, "full_mask": visible}[padding]
    calls = _count_calls(monkeypatch, "flash_attn_varlen_func", "flash_attn_with_kvcache")
    module = _Attention() if causal else _Encoder()

    def run(query):
        calls.update(dict.fromkeys(calls, 0))
        out, _ = fx.attention_forward(module, query, k, v, mask, scaling=0.3, sliding_window=window, softcap=2.0)
        return out.detach(), calls["flash_attn_with_kvcache"], calls["flash_attn_varlen_func"]

    # Causal queries after cached keys, no padding or left padding: a decode step. With
    # gradients the same call takes the other paths.
    decode = causal and padding in ("none", "left")
    unpadded = padding in ("left", "gap") and (window is None or (causal and padding == "left"))
    out, kvcache_calls, varlen_calls = run(q)
    assert (kvcache_calls, varlen_calls) == (int(decode), int(unpadded and not decode))
    outs = [out]
    if decode:
        with torch.enable_grad():
            out, kvcache_calls, varlen_calls = run(q.clone().requires_grad_())
        assert (kvcache_calls, varlen_calls) == (0, int(unpadded))
        outs.append(out)
    ref, _ = attention_ref(q, k, v, 0.3, NONE, bias=visible, softcap=2.0)
    # Causal padded query rows are not compared (the unpadded path gives them 0).
    rows = keep[:, -4:] if causal else torch.ones(2, 4, dtype=torch.bool, device=device)
    for out in outs:
        torch.testing.assert_close(out[rows], ref.transpose(1, 2)[rows], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "full"])
def test_dropout_matches_reference(device, mask_kind):
    """Dropout in training, on each path: the kept probabilities are those of the ops'
    dropout stream for the [seed, offset] drawn from torch's generator."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 9, 16, device=device, requires_grad=True)
    k, v = (torch.randn(1, 2, 9, 16, device=device, requires_grad=True) for _ in range(2))
    causal = torch.ones(9, 9, dtype=torch.bool, device=device).tril()
    mask = {"none": None, "padding": torch.ones(1, 9, dtype=torch.bool, device=device),
            "full": causal[None, None]}[mask_kind]
    if mask_kind == "padding":
        mask[0, :2] = False  # two left pads: the batch is unpadded to 7 tokens
    torch.manual_seed(3)
    out, _ = fx.attention_forward(_Attention(), q, k, v, mask, dropout=0.25, scaling=0.3)
    torch.manual_seed(3)
    rng = new_rng_state(q.device)
    n = 7 if mask_kind == "padding" else 9
    keep = dropout_mask(rng, 1, 4, n, n, 0.25).to(device)
    kv = [t[:, :, 9 - n:].repeat_interleave(2, 1).double() for t in (k, v)]
    ref, _ = attention_ref(q[:, :, 9 - n:].double(), *kv, 0.3, BOTTOM_RIGHT if mask_kind != "full" else NONE,
                           bias=causal[None, None] if mask_kind == "full" else None, keep=keep, dropout_p=0.25)
    got = out.transpose(1, 2)[:, :, 9 - n:]
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    if mask_kind == "padding":
        assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))


def test_training_step_with_dropout_is_seeded(device):
    config = _config("llama")
    config.attention_dropout = 0.3
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=NAME).to(device).train()
    ids, mask, labels = _padded_batch("llama", device)
    losses = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        losses.append(model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    losses[0].backward()
    assert losses[0] == losses[1] and losses[0] != losses[2]
    assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)


def test_names_transformers_reserves_are_refused():
    for name in ("flashattn_ext", "my_sdpa"):
        with pytest.raises(ValueError, match="reserves"):
            fx.register(name)
    assert "flash" not in NAME


def test_what_the_kernels_cannot_do_is_refused(device):
    q = torch.randn(2, 4, 5, 8, device=device)
    with pytest.raises(ValueError, match="attention_mask"):
        fx.attention_forward(_Attention(), q, q, q, torch.ones(2, 7, dtype=torch.bool, device=device))
    for sink in ("s_aux", "sinks"):
        with pytest.raises(ValueError, match=f"attention sinks \\({sink}"):
            fx.attention_forward(_Attention(), q, q, q, None, **{sink: torch.zeros(4, device=device)})


@pytest.mark.parametrize("padding", [False, True])
def test_head_dim_not_contiguous(device, padding):
    """A query, key or value whose head dim is not contiguous (a model's own transpose) is copied on the way, as
    transformers' sdpa path lets torch do: the result of contiguous tensors."""
    q, k, v = (torch.randn(2, 4, 7, 16, device=device, dtype=torch.float64) for _ in range(3))
    mask = None
    if padding:
        mask = torch.ones(2, 7, dtype=torch.bool, device=device)
        mask[1, :2] = False
    want, _ = fx.attention_forward(_Attention(), q, k, v, mask, scaling=0.3)
    for which in range(3):
        args = [q, k, v]
        args[which] = args[which].transpose(-1, -2).contiguous().transpose(-1, -2)
        got, _ = fx.attention_forward(_Attention(), *args, mask, scaling=0.3)
        assert torch.equal(got, want)
