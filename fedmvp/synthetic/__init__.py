"""The offline stand-in for real data and real weights: the synthetic attribute world (classes,
rendering, the ImageFolder writer) and the tiny CLIP pretrained on it (tokenizer, pretraining,
zero-shot measurement). See docs/tiny-clip.md."""
