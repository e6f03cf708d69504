"""tensors."""
