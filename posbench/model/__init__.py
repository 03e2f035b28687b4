"""The decoder-only model that every scheme is trained in (gpt), its attention layer and its two blocks, GPT-2's and
Llama's (blocks), its tied head and loss in one op (head), the one builder from a model spec (build), the memory
estimate of a training step or an evaluation pass (memory), and a Hugging Face checkpoint (Llama, Mistral, Qwen 2 and
3, SmolLM3) rebuilt as a posbench model (pretrained), and the inverse: a Llama-block model as the transformers model
that computes it (export).

Imports attention, schemes and config; knows no scheme by name and nothing of training. Start with gpt.py.
"""
