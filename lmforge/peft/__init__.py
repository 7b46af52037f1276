"""Parameter-efficient fine-tuning: LoRA (``lora``), QLoRA with an NF4 base (``qlora``),
bottleneck adapters (``adapter``), the run settings and ``apply_peft`` (``config``), and what a
run saves / how a saved adapter is applied (``export``). Import from the module that defines a
name: this package re-exports nothing."""
