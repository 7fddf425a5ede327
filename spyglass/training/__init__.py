"""Training-side library code (no Ray here): offline corpora, Anchor-Offset positions, draft models, losses.

The Ray parts (extraction actors, the Ray Train trainer, job entry points) live in `actors/`.
"""
