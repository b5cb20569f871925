"""Tensor name prefixes: how a run's checkpoint, a bundle and an update file name their tensors.

Why here: the server picks the PromptFormer's tensors out of a round and the LoRA out of an update
by these prefixes, and the device does the same on the bundle's side; one spelling for all.
"""

PROMPTFORMER_PREFIX = "promptformer."  # the PromptFormer's parameters (the digest covers these)
LORA_PREFIX = "lora."  # the LoRA adapters (what an update file holds, and only those)
