import json
import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # pytest -n N: the N workers share the cores instead of each taking all
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The packaged SmolLM2-135M-Instruct, converted once to a cached HF directory. NANOSPEC_SMOLLM2: the same
    model from elsewhere (the GPU machine has no asset wheel, only the staged GGUF: experiments/h200_scale.sh)."""
    from models.target import resolve_target  # heavy (torch): conftest loads in every run, torch-free ones too

    return resolve_target(os.environ.get("NANOSPEC_SMOLLM2", "smollm2"))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from models.target import load_tokenizer  # heavy (torch): conftest loads in every run, torch-free ones too

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_run_inputs(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama target directory (SmolLM2's tokenizer and chat template) and a short
    messages-style JSONL of chats, for end-to-end train.py runs that take seconds."""
    from data.datasets import load_records  # heavy (torch): conftest loads in every run, torch-free ones too
    from tests.tiny import tiny_llama  # heavy (torch, then transformers): as load_records

    root = tmp_path_factory.mktemp("tiny")
    model = tiny_llama(vocab=len(smollm2_tokenizer), hidden=64, layers=4, heads=4, kv_heads=2)
    model.save_pretrained(root / "target")
    smollm2_tokenizer.save_pretrained(root / "target")
    try:
        chats = [
            [
                {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"][:200]}
                for t in rec["conversations"][:4]
            ]
            for rec in load_records("sharegpt", limit=60)
        ]
    except FileNotFoundError:  # no ShareGPT wheel (the GPU machine): the repository's own greedy replies to it
        chats = [
            [{**m, "content": m["content"][:200]} for m in rec["messages"][:4]]
            for rec in load_records("sharegpt-greedy", limit=60)
        ]
    with open(root / "chats.jsonl", "w") as f:
        for msgs in chats:
            f.write(json.dumps({"messages": msgs}) + "\n")
    return root / "target", root / "chats.jsonl"
