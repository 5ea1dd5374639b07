output "dns_delegation_records" {
  description = "Add these at your registrar (the parent zone): the NS records of meridian.example. and their glue."
  value       = module.global.dns_delegation_records
}

output "region_endpoints" {
  description = "Each region's client-facing endpoint."
  value = {
    "us-east"    = module.us_east.endpoint
    "eu-west"    = module.eu_west.endpoint
    "eu-central" = module.eu_central.endpoint
  }
}

output "load_balancer_ingress" {
  description = "What the clouds gave the agents' balancers: each must match its region's endpoint."
  value = {
    "us-east"    = module.us_east.load_balancer_ingress
    "eu-west"    = module.eu_west.load_balancer_ingress
    "eu-central" = module.eu_central.load_balancer_ingress
  }
}

output "admin_api_url" {
  description = "The admin API (meridianctl's MERIDIAN_URL through the internal balancer or a port-forward)."
  value       = module.global.admin_api_url
}

output "admin_tls_dns_names" {
  description = "Names the admin certificate must carry (DNS subjectAltNames)."
  value       = module.global.admin_tls_dns_names
}

output "admin_tls_ip_addresses" {
  description = "Addresses the admin certificate must carry (IP subjectAltNames): the internal balancer of MERIDIAN_URL."
  value       = module.global.admin_tls_ip_addresses
}

output "etcd_tls_dns_names" {
  description = "Names the etcd members' certificate must carry (DNS subjectAltNames)."
  value       = module.global.etcd_tls_dns_names
}

output "etcd_tls_ip_addresses" {
  description = "Addresses the etcd members' certificate must carry (IP subjectAltNames): the internal balancer the regions dial."
  value       = module.global.etcd_tls_ip_addresses
}

output "etcd_users" {
  description = "The CN each etcd client certificate must carry: root, meridian-controller, agent-<region>."
  value       = module.global.etcd_users
}

output "etcd_client_urls" {
  description = "etcd client URLs the agents use."
  value       = module.global.etcd_client_urls
}

output "etcd_bootstrap_job" {
  description = "The etcd-bootstrap Job of this apply, in namespace meridian-global: its log says what it changed."
  value       = module.global.etcd_bootstrap_job
}
