"""Models the course trains on the CPU: sequence-to-sequence RNNs (lesson 01) and small transformers (lessons 03 and 04)."""
