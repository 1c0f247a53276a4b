"""The Hugging Face integration: attn_implementation="kernel_lab" and the RoPE patch on a tiny
random Llama, against the same model with transformers' eager attention. Skipped (with the
reason) when transformers is not installed."""

import importlib.util

import pytest
import torch

from kernel_lab.attention import flash_attention, modules, patch_hf, register_hf
from kernel_lab.shared import reference, testing

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
FWD_FACTOR = 2.0  # the attention forward's factor (docs/correctness.md)


@pytest.mark.skipif(HAS_TRANSFORMERS, reason="transformers is installed")
def test_register_hf_without_transformers_raises_clear_import_error():
    with pytest.raises(ImportError, match="need the `transformers` package"):
        register_hf()
    with pytest.raises(ImportError, match="need the `transformers` package"):
        patch_hf(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("feature, match", [({"softcap": 50.0}, "soft-capping"),
                                            ({"s_aux": torch.zeros(2)}, "attention sinks")])
def test_hf_attention_forward_refuses_what_it_cannot_compute(feature, match):
    """Logit soft-capping and attention sinks (gpt-oss `s_aux`) change the softmax: refused with a
    clear error, not silently dropped (no transformers needed: the function is called directly)."""
    q = k = v = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=match):
        modules.hf_attention_forward(torch.nn.Module(), q, k, v, None, **feature)


def _tiny_llama(device, attn_implementation, dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.config._attn_implementation = attn_implementation
    return model


@pytest.mark.interpret
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_hf_llama_with_kernel_lab_attention_and_rope_matches_eager(kernel_device, seed, monkeypatch):
    register_hf()
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs.get("causal"))
        return flash_attention(*args, **kwargs)

    monkeypatch.setattr(modules, "flash_attention", counting)
    ids = torch.randint(0, 97, (2, 21), generator=testing.make_generator(seed)).to(kernel_device)
    eager = _tiny_llama(kernel_device, "eager")
    eager64 = _tiny_llama(kernel_device, "eager", torch.float64)  # the same weights, in float64
    ours = _tiny_llama(kernel_device, "kernel_lab")
    # A padded batch takes the explicit-mask path (row 1 is unpadded and compared).
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        # Reference: the float64 eager model; baseline: the float32 eager model (stock HF),
        # all computed before the module-wide RoPE patch below.
        ref, expected = eager64(ids).logits, eager(ids).logits
        ref_masked = eager64(ids, attention_mask=mask).logits[1]
        expected_masked = eager(ids, attention_mask=mask).logits[1]
        got = ours(ids).logits
        assert calls == [True, True], "the kernel did not run in both layers"
        testing.assert_close_to_reference(got, ref, expected, factor=FWD_FACTOR, name="hf logits")
        # The RoPE patch on top (module-wide; restored below so other tests see stock HF).
        module = __import__(type(ours.model.layers[0].self_attn).__module__, fromlist=["x"])
        original = module.apply_rotary_pos_emb
        try:
            patch_hf(ours)
            assert module.apply_rotary_pos_emb is not original
            testing.assert_close_to_reference(ours(ids).logits, ref, expected, factor=FWD_FACTOR,
                                              name="hf logits with rope patch")
        finally:
            module.apply_rotary_pos_emb = original
        testing.assert_close_to_reference(ours(ids, attention_mask=mask).logits[1], ref_masked, expected_masked,
                                          factor=FWD_FACTOR, name="hf logits with padding mask")


@pytest.mark.interpret
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_hf_generate_with_kv_cache_matches_eager(kernel_device, seed, monkeypatch):
    """Decoding against a KV cache: each step is Tq = 1 against Tk cached keys with causal=True,
    which the bottom-right convention turns into "see every key" (SDPA's top-left would not)."""
    register_hf()
    shapes = []

    def recording(q, k, v, **kwargs):
        shapes.append((q.shape[-2], k.shape[-2]))
        return flash_attention(q, k, v, **kwargs)

    monkeypatch.setattr(modules, "flash_attention", recording)
    ids = torch.randint(0, 97, (1, 9), generator=testing.make_generator(seed)).to(kernel_device)
    eager = _tiny_llama(kernel_device, "eager")
    ours = _tiny_llama(kernel_device, "kernel_lab")
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = eager.generate(ids, **kw)
        got = ours.generate(ids, **kw)
    assert torch.equal(got, expected)
    assert (1, 10) in shapes, f"no single-token decode step reached the kernel: {shapes}"


def test_only_a_rotate_half_rope_is_replaced():
    """GLM's and Cohere's apply_rotary_pos_emb (interleaved pairs) share the name and signature of
    the rotate_half one: patch_hf probes the function and refuses them (their logits would move)."""

    def interleaved(q, k, cos, sin):
        return reference.apply_rope(q, k, cos, sin, interleaved=True, compute_dtype=torch.float32)

    def rotate_half(q, k, cos, sin):
        return reference.apply_rope(q, k, cos, sin, compute_dtype=torch.float32)

    assert modules._is_rotate_half_rope(rotate_half) and not modules._is_rotate_half_rope(interleaved)
