#!/bin/bash
# Entry point of each Kafka node of the replicated stack (deploy/stack-ha.yml, apache/kafka
# image): one combined KRaft broker/controller of a three-node cluster, with the same client
# security as the single node (deploy/kafka/secure-entrypoint.sh): a SASL_SSL listener
# (SCRAM-SHA-512), the StandardAuthorizer, nothing allowed without an ACL.
#
# What differs from the single node:
# * The controller listener crosses machines, so it is SSL with client certificates required
#   (mutual TLS): only a holder of the broker key (the docker secret hadar_kafka_server_pem)
#   can join the quorum or speak to a controller. Its principal, the certificate's subject
#   (KAFKA_CONTROLLER_PRINCIPAL, `CN=hadar kafka` for `hadar infra certs`), is a super user
#   in place of the single node's ANONYMOUS. The certificate must name kafka-1, kafka-2 and
#   kafka-3 (`hadar infra certs --host kafka-1 --host kafka-2 --host kafka-3`).
# * Every topic -- Hadar's (default.replication.factor), the consumer offsets and the
#   transaction state -- has three replicas, and an acks=all write is acknowledged once two
#   have it (min.insync.replicas=2); an out-of-sync replica never becomes leader.
#
# Environment:
#   KAFKA_NODE_ID          1, 2 or 3
#   KAFKA_ADVERTISED_HOST  the name clients and the other nodes reach this node by (kafka-N)
#   KAFKA_QUORUM_VOTERS    the static controller quorum, id@host:port,... (all three nodes)
#   KAFKA_QUORUM           static (default): the static quorum above (a new cluster);
#                          join: every node of a cluster whose quorum is dynamic (kraft.version
#                          1), as one grown from the single-node stack is: the voters serve as
#                          controller.quorum.bootstrap.servers, and a node with empty storage is
#                          formatted --no-initial-controllers and made a voter afterwards with
#                          `kafka-metadata-quorum.sh add-controller` (deploy/README.md, "Growing
#                          from the single-node stack"; $work/controller-client.properties is
#                          the --command-config it takes).
#   CLUSTER_ID             the cluster id all three nodes are formatted with
# Secrets, from files only (never the command line or the environment):
#   /run/secrets/kafka-admin-password, /run/secrets/kafka-server-pem, /run/secrets/kafka-ca
set -euo pipefail
umask 077
: "${KAFKA_NODE_ID:?set KAFKA_NODE_ID}" "${KAFKA_ADVERTISED_HOST:?set KAFKA_ADVERTISED_HOST}"
: "${KAFKA_QUORUM_VOTERS:?set KAFKA_QUORUM_VOTERS}" "${CLUSTER_ID:?set CLUSTER_ID}"
work=/tmp/hadar-kafka
mkdir -p "$work"
admin_password=$(cat /run/secrets/kafka-admin-password)
conf=$work/server.properties
case "${KAFKA_QUORUM:-static}" in
  static) quorum="controller.quorum.voters=${KAFKA_QUORUM_VOTERS}"; format_flags=() ;;
  join)   quorum="controller.quorum.bootstrap.servers=$(sed -E 's/(^|,)[0-9]+@/\1/g' <<<"${KAFKA_QUORUM_VOTERS}")"
          format_flags=(--no-initial-controllers) ;;
  *) echo "KAFKA_QUORUM must be static or join, got '${KAFKA_QUORUM}'" >&2; exit 2 ;;
esac
cat > "$conf" <<PROPERTIES
process.roles=broker,controller
node.id=${KAFKA_NODE_ID}
${quorum}
listeners=SASL_SSL://:9094,CONTROLLER://:9093
advertised.listeners=SASL_SSL://${KAFKA_ADVERTISED_HOST}:9094,CONTROLLER://${KAFKA_ADVERTISED_HOST}:9093
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:SSL,SASL_SSL:SASL_SSL
listener.name.controller.ssl.client.auth=required
inter.broker.listener.name=SASL_SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="${admin_password}";
ssl.keystore.type=PEM
ssl.keystore.location=/run/secrets/kafka-server-pem
ssl.truststore.type=PEM
ssl.truststore.location=/run/secrets/kafka-ca
ssl.endpoint.identification.algorithm=https
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:admin;User:${KAFKA_CONTROLLER_PRINCIPAL:-CN=hadar kafka}
allow.everyone.if.no.acl.found=false
connections.max.reauth.ms=300000
log.dirs=/var/lib/kafka/data
num.partitions=3
default.replication.factor=3
min.insync.replicas=2
offsets.topic.replication.factor=3
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
unclean.leader.election.enable=false
auto.create.topics.enable=false
PROPERTIES
# The admin client settings of the quorum tools (kafka-metadata-quorum.sh, kafka-features.sh
# --bootstrap-controller): this node's own config, so that `add-controller` finds its id,
# directory and endpoint, plus SSL to the controller listener with this node's certificate.
{ cat "$conf"; echo security.protocol=SSL; } > "$work/controller-client.properties"
if [ ! -f /var/lib/kafka/data/meta.properties ]; then
  # A Java @argfile keeps the password off the command line (ps, /proc/*/cmdline).
  args=$work/format.args
  printf '%s\n' kafka.tools.StorageTool format -t "${CLUSTER_ID}" -c "$conf" ${format_flags[@]+"${format_flags[@]}"} \
    --add-scram "\"SCRAM-SHA-512=[name=admin,password=${admin_password}]\"" > "$args"
  java -cp "/opt/kafka/libs/*" "@$args"
  rm -f "$args"
fi
exec /opt/kafka/bin/kafka-server-start.sh "$conf"
