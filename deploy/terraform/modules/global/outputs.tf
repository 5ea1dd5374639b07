output "etcd_client_urls" {
  description = "etcd client URLs (https://) for the regions' agents: the internal balancer when etcd_load_balancer_ip is set, else the members' in-cluster names (or etcd_external_endpoints)."
  value       = local.run_etcd && var.etcd_load_balancer_ip != null ? ["https://${var.etcd_load_balancer_ip}:2379"] : local.etcd_client_urls
}

output "etcd_member_urls" {
  description = "Every etcd member's client URL as the controllers use them (in-cluster names, or etcd_external_endpoints)."
  value       = local.etcd_client_urls
}

output "etcd_tls_dns_names" {
  description = "DNS names the members' certificate (etcd_member_cert) must carry (subjectAltName DNS entries): every member's in-cluster name, for clients and peers. Empty with etcd_external_endpoints."
  value       = local.run_etcd ? ["*.${local.etcd_peers}.${var.namespace}.${local.cluster_domain}"] : []
}

output "etcd_tls_ip_addresses" {
  description = "Addresses the members' certificate must carry as IP subjectAltNames: the internal balancer the other regions' agents dial (etcd_load_balancer_ip). Empty without one."
  value       = local.run_etcd && var.etcd_load_balancer_ip != null ? [var.etcd_load_balancer_ip] : []
}

output "etcd_users" {
  description = "The etcd users the etcd-bootstrap Job creates, each the CN of its client certificate: root (etcd_root_cert), the controllers (controller_etcd_cert), and one per region (module region's etcd_client_cert)."
  value = {
    root       = "root"
    controller = "meridian-controller"
    regions    = { for r in var.regions : r.id => "agent-${r.id}" }
  }
}

output "etcd_bootstrap_job" {
  description = "Name of the current etcd-bootstrap Job (kubectl logs job/<name> shows what it changed)."
  value       = local.bootstrap_job_name
}

output "admin_api_url" {
  description = "The admin API inside the cluster (meridianctl's MERIDIAN_URL through a port-forward or the internal balancer)."
  value       = "https://${local.controller_name}-admin.${var.namespace}.${local.cluster_domain}:${var.admin_port}"
}

output "admin_tls_dns_names" {
  description = "Names the admin certificate must carry (subjectAltName DNS entries): every replica, for forwarded writes, and the admin Service."
  value = [
    "*.${local.controller_peers}.${var.namespace}.${local.cluster_domain}",
    "${local.controller_name}-admin.${var.namespace}.${local.cluster_domain}",
  ]
}

output "admin_tls_ip_addresses" {
  description = "Addresses the admin certificate must carry as IP subjectAltNames: the internal balancer (admin_load_balancer_ip) that meridianctl dials as https://<address>:<admin_port>. Empty without one."
  value       = var.admin_load_balancer_ip != null ? [var.admin_load_balancer_ip] : []
}

output "dns_server" {
  description = "The address the controller sends RFC 2136 updates to (dns.server)."
  value       = local.dns_server
}

output "dns_delegation_records" {
  description = "Records to add at the parent zone (the registrar): NS for the zone and glue for in-zone name servers."
  value = concat(
    [for ns in var.dns_nameservers : "${var.dns_zone} 86400 IN NS ${ns.name}"],
    [for g in local.glue : "${g.name} 86400 IN ${g.type} ${g.address}"],
  )
}

output "controller_config" {
  description = "The controllers' rendered settings (controller.toml), for review."
  value       = local.controller_config
}
