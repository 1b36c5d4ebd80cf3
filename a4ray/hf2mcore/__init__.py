"""HF -> Megatron-core checkpoint conversion as a job (`python -m a4ray.convert`) and a pipeline step:
parallel, memory-bounded, verified, cached.

    import a4ray

    result = a4ray.run(a4ray.load("jobs/convert.yaml"))     # or `a4ray convert -f jobs/convert.yaml`
    result.status        # "ran" | "cached" | "skipped"
    result.checkpoint    # the committed checkpoint directory: the trainer's --load
    result.verify        # logits and round-trip figures

Backends: `native` (Ray tasks over layer ranges, Qwen3, Qwen3-MoE and Qwen3-Next), `pai` (Pai-Megatron-Patch's
distributed converter on every node), `swift` (ms-swift's `swift export --to_mcore`).

Qwen3-Next converts natively to megatron-core's own hybrid GPTModel (`experimental_attention_variant=
"gated_delta_net"`, TE names, torch_dist; `mapping` says how). It is verified as the others are, by the
exact round trip of every tensor and by its logits on the CPU (its layers on megatron-core's local ones,
`a4ray.mcore.hybrid`); its MTP layer is not converted, and the result says so.

`converter.ConvertWorkload` is the job: a cache check, the backend, verification, the atomic commit. A
pipeline's convert step runs it on the pipeline's connection and run directory; `job.convert` is the
`convert:` section (`a4ray.spec.conversion.ConvertSpec`) a recipe embeds.
"""
