output "endpoint" {
  description = "The region's client-facing endpoint (the first of endpoints), as the agents publish it for DNS."
  value       = var.endpoints[0]
}

output "endpoints" {
  description = "Every client-facing URL of the region."
  value       = var.endpoints
}

output "load_balancer_ingress" {
  description = "Addresses (or host names) the cloud gave the agents' LoadBalancer; they must match endpoints."
  value = [
    for ingress in try(kubernetes_service_v1.agent.status[0].load_balancer[0].ingress, []) :
    coalesce(ingress.ip, ingress.hostname)
  ]
}

output "namespace" {
  description = "The region's namespace."
  value       = kubernetes_namespace_v1.region.metadata[0].name
}

output "vllm_service" {
  description = "DNS name of the headless Service of the vLLM pods (one A record per ready pod)."
  value       = local.agent_config_vars.vllm_service
}

output "agent_config" {
  description = "The agents' rendered settings (agent.toml), for review."
  value       = local.agent_config
}

output "etcd_user" {
  description = "The etcd user of the region's agents, agent-<region_id>: the CN etcd_client_cert must carry, created with its role by module global's etcd-bootstrap Job."
  value       = "agent-${var.region_id}"
}
