"""What users run: the GPT training job behind ``jobs/train.py`` and the gloo demo behind ``jobs/demo.py``.

``gpt`` is the model and its generated data, ``gpt_job`` the TorchTrainer job
(arguments, the train loop, resume), ``demo`` a 4 -> 3 save/load without Ray.
May import anything in rayckpt.
"""
