"""The trained draft networks the learned drafters run (`spyglass.drafters`), each with its checkpoint format; their
training losses are in `spyglass.training.losses`. They share the target's frozen embedding and LM head."""


def target_shape(a, **overrides) -> dict:
    """A draft config's fields taken from the target's (`ModelArgs`), with the given overrides (None: keep)."""
    shape = dict(
        hidden_size=a.hidden_size,
        n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads,
        head_dim=a.head_dim,
        intermediate_size=a.intermediate_size,
        vocab_size=a.vocab_size,
        rms_eps=a.rms_eps,
    )
    return shape | {k: v for k, v in overrides.items() if v is not None}
