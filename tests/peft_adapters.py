"""LoRA adapters for the tests, written by PEFT itself over a tiny transformers model, and the reference each is
held to: the base model with the adapter merged by PEFT (`merge_and_unload`), saved beside it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Adapter:
    path: Path  # the PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
    merged: Path  # the base model with the adapter merged, with the base's tokenizer


@functools.cache
def make_adapter(
    base: Path,
    root: Path,
    name: str,
    rank: int,
    targets: tuple[str, ...] = ALL_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    scale: float = 0.2,
) -> Adapter:
    """A PEFT LoRA adapter of `base` (a saved transformers model directory) with random A and B (B's entries of
    std `scale`: large enough that every adapter's greedy path differs from the base's), saved under root/name."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(targets),
        use_rslora=use_rslora,
        init_lora_weights=False,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for parameter_name, parameter in peft_model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.normal_(0.0, scale)
    adapter = Adapter(root / name, root / f"{name}-merged")
    peft_model.save_pretrained(adapter.path)
    peft_model.merge_and_unload().save_pretrained(adapter.merged)
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(adapter.merged)
    return adapter
