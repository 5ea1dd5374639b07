# Three regions (us-east, eu-west, eu-central), each on its own cluster, and the global plane in
# eu-central: EU data stays in the EU (eu-west and eu-central back each other up), us-east may
# fail over to Europe, and clients are steered by one DNS view per geography.
#
# Fill in terraform.tfvars (terraform.tfvars.example) and the addresses below: the 192.0.2.x,
# 198.51.100.x and 203.0.113.x addresses are documentation ranges (RFC 5737) and the 10.x ones
# private; reserve your own and put them here. docs/deploy.md walks through it.

locals {
  model = "meta-llama/Llama-3.1-8B-Instruct"
}

module "global" {
  source    = "../../modules/global"
  providers = { kubernetes = kubernetes.eu_central }

  namespace = "meridian-global"

  regions = [
    { id = "us-east", geo = "us", residency = [], backups = ["eu-central", "eu-west"], lat = 39.0, lon = -77.5 },
    { id = "eu-west", geo = "eu", residency = ["eu"], backups = ["eu-central"], lat = 53.3, lon = -6.3 },
    { id = "eu-central", geo = "eu", residency = ["eu"], backups = ["eu-west"], lat = 50.1, lon = 8.7 },
  ]
  latency_ms = {
    "us-east"    = { "eu-west" = 75, "eu-central" = 90 }
    "eu-west"    = { "us-east" = 75, "eu-central" = 25 }
    "eu-central" = { "us-east" = 90, "eu-west" = 25 }
  }

  etcd_image            = var.etcd_image
  etcd_replicas         = 5
  etcd_load_balancer_ip = "10.30.0.100" # internal: reached by the other clusters over your interconnect
  # etcd over TLS with client certificates; the etcd-bootstrap Job (as root) gives each region
  # its own user and role and enables auth. README.md, "etcd certificates", issues them.
  etcd_ca_cert         = var.etcd_ca_cert
  etcd_member_cert     = var.etcd_member_cert
  etcd_member_key      = var.etcd_member_key
  controller_etcd_cert = var.controller_etcd_cert
  controller_etcd_key  = var.controller_etcd_key
  etcd_root_cert       = var.etcd_root_cert
  etcd_root_key        = var.etcd_root_key

  controller_image       = var.meridian_image
  controller_replicas    = 3
  admin_load_balancer_ip = "10.30.0.91" # internal: meridianctl's MERIDIAN_URL
  admin_tls_cert         = var.admin_tls_cert
  admin_tls_key          = var.admin_tls_key
  # SHA-256 of clearly fake tokens ("example-viewer-token-do-not-use", ...): replace each with
  # the entry `meridianctl token new --name <who> --role <role>` prints.
  admin_tokens = [
    { name = "dashboards", role = "viewer", sha256 = "4ea2b300c5fa7a638ec5b70d3778d75b4c09235381935ea7c2ef450ec87cce45" },
    { name = "oncall", role = "operator", sha256 = "6ab1fe4b0a1915f8e55d84e26726ffcd85632cfa464867ba8ba0b48d5ec6c25a" },
    { name = "platform-admin", role = "admin", sha256 = "a13b46d1d42b6f85aeee6054ff64d69e6a04a66d8b4bd2494be22132cf8977ab" },
  ]

  dns_zone = "meridian.example."
  dns_views = [
    { name = "eu", geo = "eu", match_clients = ["198.51.100.0/24", "203.0.113.0/24"] },
    { name = "default", geo = "us", match_clients = [] },
  ]
  dns_ttl_s            = 30
  tsig_secret          = var.tsig_secret
  bind_image           = var.bind_image
  bind_cluster_ip      = "10.96.0.53" # inside eu-central's service range
  dns_load_balancer_ip = "203.0.113.53"
  dns_nameservers      = [{ name = "ns1.meridian.example.", address = "203.0.113.53" }]
  hostmaster           = "hostmaster.meridian.example."
}

module "us_east" {
  source    = "../../modules/region"
  providers = { kubernetes = kubernetes.us_east }

  region_id        = "us-east"
  geo              = "us"
  residency        = []
  namespace        = "meridian"
  endpoints        = ["https://192.0.2.10"]
  load_balancer_ip = "192.0.2.10"
  etcd_endpoints   = module.global.etcd_client_urls
  etcd_ca_cert     = var.etcd_ca_cert
  etcd_client_cert = var.agent_etcd_certs["us-east"] # CN agent-us-east
  etcd_client_key  = var.agent_etcd_keys["us-east"]

  model          = local.model
  vllm_image     = var.vllm_image
  agent_image    = var.meridian_image
  vllm_replicas  = 4
  gpus_per_node  = 1
  agent_replicas = 2
  admin_token    = var.agent_admin_tokens["us-east"]
  hf_token       = var.hf_token
}

module "eu_west" {
  source    = "../../modules/region"
  providers = { kubernetes = kubernetes.eu_west }

  region_id        = "eu-west"
  geo              = "eu"
  residency        = ["eu"]
  namespace        = "meridian"
  endpoints        = ["https://198.51.100.10"]
  load_balancer_ip = "198.51.100.10"
  etcd_endpoints   = module.global.etcd_client_urls
  etcd_ca_cert     = var.etcd_ca_cert
  etcd_client_cert = var.agent_etcd_certs["eu-west"] # CN agent-eu-west
  etcd_client_key  = var.agent_etcd_keys["eu-west"]

  model          = local.model
  vllm_image     = var.vllm_image
  agent_image    = var.meridian_image
  vllm_replicas  = 4
  gpus_per_node  = 1
  agent_replicas = 2
  admin_token    = var.agent_admin_tokens["eu-west"]
  hf_token       = var.hf_token
}

module "eu_central" {
  source    = "../../modules/region"
  providers = { kubernetes = kubernetes.eu_central }

  region_id        = "eu-central"
  geo              = "eu"
  residency        = ["eu"]
  namespace        = "meridian"
  endpoints        = ["https://203.0.113.10"]
  load_balancer_ip = "203.0.113.10"
  etcd_endpoints   = module.global.etcd_client_urls
  etcd_ca_cert     = var.etcd_ca_cert
  etcd_client_cert = var.agent_etcd_certs["eu-central"] # CN agent-eu-central
  etcd_client_key  = var.agent_etcd_keys["eu-central"]

  model          = local.model
  vllm_image     = var.vllm_image
  agent_image    = var.meridian_image
  vllm_replicas  = 2
  gpus_per_node  = 1
  agent_replicas = 2
  admin_token    = var.agent_admin_tokens["eu-central"]
  hf_token       = var.hf_token
}
