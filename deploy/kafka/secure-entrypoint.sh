#!/bin/bash
# Entry point of the stack's Kafka (apache/kafka image): one combined KRaft node with a
# SASL_SSL listener (SCRAM-SHA-512) for clients and the StandardAuthorizer, the same
# configuration as `hadar infra up --secure` (devinfra/broker_auth.py).
# Secrets come from files (docker secrets), never from the command line or the environment:
#   /run/secrets/kafka-admin-password   the admin principal's password (a super user)
#   /run/secrets/kafka-server-pem       the broker's PKCS#8 key + certificate chain (PEM)
#   /run/secrets/kafka-ca               the CA certificate clients and the broker trust
# The admin's SCRAM user is created when the storage is formatted (first start); the
# services' users and ACLs are created by the init service (`hadar infra secure-init`).
set -euo pipefail
umask 077
work=/tmp/hadar-kafka
mkdir -p "$work"
admin_password=$(cat /run/secrets/kafka-admin-password)
conf=$work/server.properties
cat > "$conf" <<PROPERTIES
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@localhost:9093
listeners=SASL_SSL://:9094,CONTROLLER://localhost:9093
advertised.listeners=SASL_SSL://${KAFKA_ADVERTISED_HOST:-kafka}:9094
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL
inter.broker.listener.name=SASL_SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="${admin_password}";
ssl.keystore.type=PEM
ssl.keystore.location=/run/secrets/kafka-server-pem
ssl.truststore.type=PEM
ssl.truststore.location=/run/secrets/kafka-ca
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:admin;User:ANONYMOUS
allow.everyone.if.no.acl.found=false
connections.max.reauth.ms=300000
log.dirs=/var/lib/kafka/data
num.partitions=3
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
auto.create.topics.enable=false
PROPERTIES
if [ ! -f /var/lib/kafka/data/meta.properties ]; then
  # A Java @argfile keeps the password off the command line (ps, /proc/*/cmdline).
  args=$work/format.args
  printf '%s\n' kafka.tools.StorageTool format -t "${CLUSTER_ID}" -c "$conf" \
    --add-scram "\"SCRAM-SHA-512=[name=admin,password=${admin_password}]\"" > "$args"
  java -cp "/opt/kafka/libs/*" "@$args"
  rm -f "$args"
fi
exec /opt/kafka/bin/kafka-server-start.sh "$conf"
