"""The save and load engine: one way from a state dict to committed files and back.

``state`` flattens state dicts (nested containers, DTensors, Stateful objects)
into keys, global boxes and local tensors; ``coordinator`` is the one collective
(an all-gather that carries failures); ``writer`` turns tensors into chunks and
shard files; ``reader`` carries out a load plan with verified ranged reads;
``save`` and ``load`` are the four named steps (collect -> plan -> write ->
commit; plan -> read -> finish) that the Ray layer reuses. May import
``format``, ``planning``, ``storage`` and torch; never Ray, ``train`` or ``tools``.
"""
