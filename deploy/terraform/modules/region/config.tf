# The agent's settings, rendered from templates/agent.toml.tftpl, and what its Secret holds.
# Only variables feed these locals (no resource attributes), so that tests/deploy renders
# exactly this with the example's values, loads the result with Meridian's own settings loader
# and writes the Secret's files where the settings say they are.

locals {
  vllm_name    = "vllm"
  vllm_service = "vllm-nodes" # headless: one DNS name per vLLM pod
  agent_name   = "meridian-agent"

  # The agent's Secret is mounted here (not under /etc/meridian, the ConfigMap's read-only
  # mount): admin.token_file and the region.etcd_* files name its keys.
  secrets_dir     = "/run/secrets/meridian"
  admin_token_key = "admin-token"

  # etcd over TLS: the members' CA and this region's client certificate (CN agent-<region>)
  # with its key, three more keys of the same Secret. Validation makes them go together with
  # https:// etcd_endpoints.
  etcd_tls = var.etcd_ca_cert != null
  etcd_files = {
    ca_file   = "etcd-ca.crt"
    cert_file = "etcd-client.crt"
    key_file  = "etcd-client.key"
  }

  # The Secret's keys, each a file under secrets_dir in the agent's pod.
  agent_secret_data = merge(
    { (local.admin_token_key) = var.admin_token },
    local.etcd_tls ? {
      (local.etcd_files.ca_file)   = var.etcd_ca_cert
      (local.etcd_files.cert_file) = var.etcd_client_cert
      (local.etcd_files.key_file)  = var.etcd_client_key
    } : {},
  )

  # Stopping an agent pod: the preStop sleep (agent_shutdown_delay_s) while the balancer takes
  # it out, then SIGTERM: the agent closes its listener, waits up to 60 s for the requests in
  # flight (aiohttp's AppRunner shutdown_timeout, which meridian_service.serving leaves at its
  # default), then revokes its etcd lease (region.etcd_timeout_s per member tried) and flushes
  # its telemetry: 10 s of margin for that. The grace period counts from the preStop hook.
  agent_shutdown_timeout_s  = 60
  agent_termination_grace_s = var.agent_shutdown_delay_s + local.agent_shutdown_timeout_s + 10

  # The vLLM pods by their stable names under the headless Service:
  # vllm-0.vllm-nodes.<namespace>.svc.cluster.local, vllm-1..., one [[nodes]] entry each.
  vllm_node_urls = [
    for i in range(var.vllm_replicas) :
    "http://${local.vllm_name}-${i}.${local.vllm_service}.${var.namespace}.svc.cluster.local:${var.vllm_port}"
  ]

  agent_config_vars = {
    region_id      = var.region_id
    geo            = var.geo
    residency      = var.residency
    endpoints      = var.endpoints
    etcd_endpoints = var.etcd_endpoints
    # One entry with TLS, none without: the template's loop writes the three lines or nothing.
    etcd_tls = local.etcd_tls ? [{
      ca_file   = "${local.secrets_dir}/${local.etcd_files.ca_file}"
      cert_file = "${local.secrets_dir}/${local.etcd_files.cert_file}"
      key_file  = "${local.secrets_dir}/${local.etcd_files.key_file}"
    }] : []
    agent_port     = var.agent_port
    slots_per_node = var.slots_per_node
    vllm_service   = "${local.vllm_service}.${var.namespace}.svc.cluster.local"
    node_urls      = local.vllm_node_urls
    token_file     = "${local.secrets_dir}/${local.admin_token_key}"
  }

  agent_config = templatefile("${path.module}/templates/agent.toml.tftpl", local.agent_config_vars)
}
