"""DeepSpeed-native pretraining and GRPO for Mixture-of-Experts language models (see README.md)."""
