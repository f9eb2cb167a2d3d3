"""The settings every small CPU training run in the tests shares; each test adds its own batch, lengths and seed."""

TINY_RUN = dict(
    learning_rate=5e-2,
    lora_r=4,
    lora_alpha=8,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    use_cpu=True,
)
