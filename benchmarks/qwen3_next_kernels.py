"""Qwen3-Next's gated delta rule on this GPU: FLA's forward against megatron-core's torch reference, and
whether FLA's backward may train here.

    python benchmarks/qwen3_next_kernels.py CONVERTED HF [--out result.json]

CONVERTED is a4ray's conversion of the HF checkpoint HF (e.g. the GPU rehearsal's
`<workspace>/ckpts/huggingface/Qwen3-Next-tiny-to-mcore/latest`). One megatron-core model of it per
(kernel, dtype), megatron-core's local layers (`a4ray.mcore.hybrid`), the same tokens; printed and
written: each run's logits against the torch reference in fp32 (the path the CPU verifier holds to the HF
model within 1e-4) and against transformers' model in fp32 on this GPU, top-1 agreement; then which path
`delta_rule_path(training=True)` takes here and why, and what FLA's gated backward does when called.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from a4ray.hf2mcore.hf import HFCheckpoint  # noqa: E402
from a4ray.mcore import checkpoint_dirs, checkpointing, shims  # noqa: E402
from a4ray.mcore.hybrid import delta_rule_path  # noqa: E402
from a4ray.mcore.model import gpt_model, init_standalone  # noqa: E402


def logits(arch, converted: Path, kernel: str, dtype: torch.dtype, tokens: torch.Tensor) -> torch.Tensor:
    model = gpt_model(arch, naming="local", dtype=dtype, kernel=kernel).cuda()  # (the shared expert's gate
    # is made on the CPU; the trainer's DDP wrapper moves it as this does)
    checkpointing.load_weights(model, checkpoint_dirs.converted_dir(converted), arch, "local")
    seq = tokens.shape[1]
    with torch.no_grad():
        out = model(input_ids=tokens, position_ids=torch.arange(seq, device=tokens.device).expand_as(tokens),
                    attention_mask=shims.causal_mask(seq).to(tokens.device))
    return out.float()


def compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    diff = (ours - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    return {"max_abs_diff": diff, "scale": scale, "rel": diff / scale,
            "top1": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()}


def fla_backward() -> str:
    """What FLA's gated chunk backward does here, on random inputs."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as error:
        return f"FLA does not import: {error}"
    b, t, h, d = 1, 128, 4, 64
    q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = (-torch.rand(b, t, h, device="cuda", dtype=torch.float32)).requires_grad_()
    beta = torch.rand(b, t, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    try:
        out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        out.sum().backward()
    except RuntimeError as error:
        return f"raises: {str(error).splitlines()[0]}"
    return "ran"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("converted")
    p.add_argument("hf")
    p.add_argument("--out")
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    init_standalone()
    arch = HFCheckpoint.open(args.hf).architecture()
    tokens = torch.randint(0, arch.vocab, (2, args.seq), generator=torch.Generator().manual_seed(0)).cuda()
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    reference = logits(arch, Path(args.converted), "torch", torch.float32, tokens)
    try:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).cuda().eval()
        with torch.no_grad():
            hf_logits = hf(input_ids=tokens).logits.float()
        del hf
    except Exception as error:  # noqa: BLE001 - the reference comparison stands without it
        hf_logits, result["hf_error"] = None, str(error).splitlines()[0]
    if hf_logits is not None:
        result["torch fp32 vs transformers fp32"] = compare(reference, hf_logits)
    for kernel, dtype in (("fla", torch.float32), ("fla", torch.bfloat16), ("torch", torch.bfloat16)):
        ours = logits(arch, Path(args.converted), kernel, dtype, tokens)
        name = f"{kernel} {str(dtype).removeprefix('torch.')}"
        result[f"{name} vs torch fp32"] = compare(ours, reference)
        if hf_logits is not None:
            result[f"{name} vs transformers fp32"] = compare(ours, hf_logits)
    result["training path"] = delta_rule_path(training=True).describe()
    result["FLA gated backward"] = fla_backward()
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
