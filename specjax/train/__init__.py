"""Training small models with optax: corpus and tokenizer (data.py), the loop with orbax
checkpoints and resume (loop.py). Used to build the bundled target/draft pair."""

from .data import Corpus, encode_files, python_corpus, sample_batch, train_tokenizer
from .loop import TrainConfig, TrainState, distill_loss, evaluate, lm_loss, train

__all__ = ["Corpus", "python_corpus", "train_tokenizer", "encode_files", "sample_batch",
           "TrainConfig", "TrainState", "train", "lm_loss", "distill_loss", "evaluate"]
