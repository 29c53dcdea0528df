"""Media: decoding images, video and audio (in isolated decoder processes), the model's
processor for vision prompts, and the embedding cache."""
