"""Training step of a Llama-style transformers model (random init, ~124M parameters by default:
hidden 768, 12 layers, 12 query / 4 key-value heads, MLP 2048, vocab 32000) with each attention
implementation: milliseconds per step (forward, backward, AdamW step), median of --steps after
--warmup, and peak memory.

Rows:
  ours        attn_implementation=flashattn_ext.transformers.register() (padded rows run unpadded)
  sdpa        transformers' sdpa, torch choosing its backend (cuDNN / flash / efficient)
  sdpa_flash  transformers' sdpa with torch's flash backend forced (FlashAttention-2 inside torch;
              transformers' own flash_attention_2 path needs the flash-attn package)
  sdpa_hook   the same with torch.nn.attention.activate_flash_attention_impl("flashattn_ext"):
              SDPA's flash backend runs our kernels
  eager       transformers' eager attention (materializes the L x L probabilities)

--pad F left-pads every other row by F * seq_len tokens (a padded batch; 0 = none); the
sdpa_flash and sdpa_hook rows need --pad 0 (torch's flash backend takes no attn_mask).

    python benchmarks/bench_hf_train_step.py [--device cuda] [--seq 4096] [--batch 2] [--pad 0.25]
        [--impls ours,sdpa,sdpa_flash,sdpa_hook] [--out results.json]
"""
import argparse
import contextlib
import json
import statistics
import time

import torch

import flashattn_ext
import flashattn_ext.transformers


def make_model(args, implementation):
    import transformers
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=implementation)
    return model.to(args.device, getattr(torch, args.dtype)).train()


def batch(args):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1::2, :int(args.pad * args.seq)] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids.to(args.device), mask.to(args.device), labels.to(args.device)


def attention_context(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if name in ("sdpa_flash", "sdpa_hook"):
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    return contextlib.nullcontext()


@contextlib.contextmanager
def hook_active(name):
    if name != "sdpa_hook":
        yield
        return
    attention = torch.nn.attention
    attention.activate_flash_attention_impl("flashattn_ext")
    try:
        yield
    finally:
        attention.restore_flash_attention_impl()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(args, name):
    implementation = {"ours": flashattn_ext.transformers.register(), "eager": "eager"}.get(name, "sdpa")
    model = make_model(args, implementation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    ids, mask, labels = batch(args)
    times = []
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with hook_active(name), attention_context(name):
        for step in range(args.warmup + args.steps):
            sync(args.device)
            t0 = time.perf_counter()
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync(args.device)
            if step >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    n_params = sum(p.numel() for p in model.parameters())
    del model, optimizer
    return {"impl": name, "ms_per_step": statistics.median(times), "loss": loss.item(), "peak_gib": peak,
            "params_m": n_params / 1e6}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--pad", type=float, default=0.0)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--impls", default="ours,sdpa,sdpa_flash,sdpa_hook")
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for name in args.impls.split(","):
        if name == "sdpa_hook" and not (args.device == "cuda" and flashattn_ext.has_cuda_kernels()
                                        and hasattr(torch.nn.attention, "activate_flash_attention_impl")):
            print(f"{name}: skipped (needs CUDA kernels and torch's flash attention hook)")
            continue
        if name in ("sdpa_flash", "sdpa_hook") and args.pad > 0:
            print(f"{name}: skipped (torch's flash backend takes no attn_mask, and a padded batch has one)")
            continue
        row = time_steps(args, name)
        rows.append(row)
        print(f"{name:>10}: {row['ms_per_step']:9.2f} ms/step  loss {row['loss']:.4f}  peak {row['peak_gib']:.2f} GiB"
              f"  ({row['params_m']:.0f}M parameters)", flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
