"""Least privilege on the bus and the store: who may do what (:mod:`.principals`, the one
table), and what applies it to running servers (:mod:`.provision`, with the Kafka requests
aiokafka lacks in :mod:`.acls` and :mod:`.scram`), the secrets it hands out
(:mod:`.credentials`, :mod:`.files`) and the development CA (:mod:`.tls`). The client side
of Kafka security is :mod:`shared.bus.settings` and :mod:`shared.bus.kafka_login`."""
