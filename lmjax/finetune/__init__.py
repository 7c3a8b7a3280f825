"""Fine-tuning (docs/fine-tuning.md): what `lmjax finetune` calls, on top of `lmjax.train`.

    config     a fine-tune config read and checked: the base run, its model and tokenizer, the
               `FinetuneSpec` the run records
    run        `finetune`: LoRA, QLoRA (the base's linears quantized to NF4 first) or a full
               fine-tune, run by `lmjax.train.loop` with a `Trainable`; the adapters and the
               merged model written at the end
    full       full fine-tuning: every base parameter trained except those a `freeze` glob names
    estimate   the memory a LoRA / QLoRA fine-tune needs, before anything is loaded
    recipe     the recipes shipped in the package (`lmjax finetune --recipe NAME`)

The adapter layer itself is `lmjax.lora` (init, apply, merge, attach), one level below
`lmjax.train`: loading any run (`lmjax.train.load_run`) rebuilds a fine-tuned run's model from
its base and adapters without importing this package. The SFT records and their loss masks are
data (`lmjax.data.sft`); the loss that reads the mask is the train step's. This package may
import everything below it (`lmjax.data`, `lmjax.train`, `lmjax.lora`, `lmjax.quant`, ...), and
only `lmjax.cli` imports it.
"""

from lmjax.finetune.config import (
    FINETUNE_FIELDS,
    MODEL_FIELDS,
    SPEC_FILE,
    check_tokenizer,
    load_config,
    records_file,
    with_base_tokenized_data,
)
from lmjax.finetune.estimate import format_memory, memory
from lmjax.finetune.recipe import recipe_names, recipe_path
from lmjax.finetune.run import (
    abstract_trainable,
    finetune,
    prepare_base_data,
    sharded_parts,
    trainable,
)
from lmjax.train.finetuned import FinetuneSpec, fingerprint, frozen_params
from lmjax.train.rundir import ADAPTERS_FILE, MERGED_DIR
from lmjax.train.runs import load_finetuned

__all__ = [
    "ADAPTERS_FILE",
    "FINETUNE_FIELDS",
    "MERGED_DIR",
    "MODEL_FIELDS",
    "SPEC_FILE",
    "FinetuneSpec",
    "abstract_trainable",
    "check_tokenizer",
    "fingerprint",
    "finetune",
    "format_memory",
    "frozen_params",
    "load_config",
    "load_finetuned",
    "memory",
    "prepare_base_data",
    "recipe_names",
    "recipe_path",
    "records_file",
    "sharded_parts",
    "trainable",
    "with_base_tokenized_data",
]
