"""Text generation from a trained model (GPT-2 sampling, T5 decoding)."""
