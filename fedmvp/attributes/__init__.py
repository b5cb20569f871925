"""Class attributes: LLM-written phrases, the sentences built from them, and their cached text features."""
