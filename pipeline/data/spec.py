"""What the model is trained on and serves: the input, the task and the meaning of the labels."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What the model is trained on and serves: the input, the task and the meaning of the labels."""

    input_name: str
    input_shape: tuple[int, ...]  # one row, without the batch dimension
    num_classes: int  # classification: the number of classes; regression: 0
    label_names: tuple[str, ...]  # classification: one name per class id; regression: ()
    task: str = "classification"  # or "regression", or "language_model" (the next token at every position)
    image_shape: tuple[int, ...] | None = None  # the rows as [height, width, channels] images, when they are images
    encoded_images: bool = False  # the rows are JPEG/PNG files decoded by images.decode_image: serving takes the bytes
    target_mean: float = 0.0  # regression: mean and standard deviation of the training targets
    target_std: float = 1.0
    vocab_size: int | None = None  # token sequences: the rows are float32 ids 0..vocab_size-1 (0: padding);
    # language_model: int32 ids of the tokenizer (pipeline/lm/tokenizers.py), num_classes of them
    token_bytes: tuple[int, ...] = ()  # language_model: the UTF-8 bytes of each id's text (nats per byte)
    categorical: tuple[int, ...] = ()  # positions in a flat row of category ids (data.categorical_columns)
    feature_names: tuple[str, ...] = ()  # one per position in a flat row, where the source names them (csv, tfrecord)

    @property
    def tokens(self) -> bool:
        return self.vocab_size is not None

    def feature_name(self, position: int) -> str:
        """'merchant_3' (csv), 'amount[2]' (tfrecord), or 'feature 7'."""
        return self.feature_names[position] if position < len(self.feature_names) else f"feature {position}"

    @property
    def num_outputs(self) -> int:
        """The width of the model's output: one score per class (language_model: per token id), or one regression
        target."""
        return 1 if self.task == "regression" else self.num_classes
