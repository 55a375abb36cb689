"""Building blocks of scripts/train_demo_model.py, one concept per module.

common: the run clock (T0), log() and write_json(); corpus: scanning, held-out split, dedup, tokenizer
training, encoding; twin: the differentiable training twin of shared.model and its checkpoint export;
train: the training loop; evaluate: evaluation of the saved checkpoint with shared.model.load_model;
card: the README.md model card rendered from metrics.json.
"""
