"""Least privilege on the bus and the store: who may do what (:mod:`.principals`), the
client side of Kafka security (:mod:`shared.config`), and the setup that applies it
(:mod:`.kafka_acls`, :mod:`.minio_users`, :mod:`.tls`, :mod:`.credentials`)."""
