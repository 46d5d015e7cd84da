"""Pattern pieces: one module per piece of the attention pattern."""
