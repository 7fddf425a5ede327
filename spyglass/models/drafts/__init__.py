"""The trained draft networks the learned drafters run (`spyglass.drafters`), each with its checkpoint format; their
training losses are in `spyglass.training.losses`. They share the target's frozen embedding and LM head."""
