"""Training small models with optax: corpus and tokenizer (data.py), the loop with orbax
checkpoints and resume (loop.py). Used to build the bundled target/draft pair."""

from .data import Corpus, python_corpus, train_tokenizer, encode_files, sample_batch
from .loop import TrainConfig, TrainState, train, lm_loss, distill_loss, evaluate

__all__ = ["Corpus", "python_corpus", "train_tokenizer", "encode_files", "sample_batch",
           "TrainConfig", "TrainState", "train", "lm_loss", "distill_loss", "evaluate"]
