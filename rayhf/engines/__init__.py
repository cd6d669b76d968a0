"""Engines: what runs a call on one rank, chosen per call (``engines:`` in the config).

RankModel       the rank's shards, forward, whole-model gather/load/save, move surface
generators      NativeGenerator (sharded, rayhf.parallel.decode), VllmGenerator
trainers        TorchTrainer (AdamW, optional ZeRO-1), DeepSpeedTrainer (ZeRO 1/2/3)
RankTrainer     the trainers' protocol; Generator: the generators'
CallEngine      what one call's interface sees: model + its generator + trainer + dp ops
config          the engine registry: one config class per engine (fields, traits, checks,
                builder), ``EngineConfig`` their union chosen by ``engine``
"""
