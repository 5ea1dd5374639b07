# Inputs of one region: its identity as the controller knows it, the vLLM pool, the agents in
# front of it, and where the global plane's etcd is. README.md has the table.

variable "region_id" {
  type        = string
  description = "Region id, as in the controller's [[regions]] and the agents' region.id, e.g. eu-west."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,62}$", var.region_id))
    error_message = "region_id must be 1-63 lowercase letters, digits and dashes, starting with a letter or digit (e.g. eu-west)."
  }
}

variable "geo" {
  type        = string
  description = "The geography the region serves: the DNS view whose answer it is in, e.g. eu or us."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,31}$", var.geo))
    error_message = "geo must be 1-32 lowercase letters, digits and dashes (e.g. eu), as the controller's [[dns.views]] geo."
  }
}

variable "residency" {
  type        = list(string)
  description = "Data-residency tags the region meets, e.g. [\"eu\"]; a region's backups must meet all of them."
  default     = []

  validation {
    condition     = alltrue([for tag in var.residency : can(regex("^[a-z0-9][a-z0-9-]{0,31}$", tag))])
    error_message = "Each residency tag must be 1-32 lowercase letters, digits and dashes (e.g. eu)."
  }
}

variable "namespace" {
  type        = string
  description = "Kubernetes namespace created for the region's vLLM pool and agents."
  default     = "meridian"

  validation {
    condition     = can(regex("^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$", var.namespace)) && var.namespace != "default"
    error_message = "namespace must be a DNS label (lowercase letters, digits, dashes, at most 63) other than \"default\"."
  }
}

variable "endpoints" {
  type        = list(string)
  description = "Client-facing URLs of the region (the agents' load balancer), published for DNS: an IP literal becomes an A/AAAA record, e.g. https://198.51.100.10."

  validation {
    condition     = length(var.endpoints) > 0 && alltrue([for url in var.endpoints : can(regex("^https?://[^/?#]+/?$", url))])
    error_message = "endpoints must hold at least one http:// or https:// URL with a host and no path (e.g. https://198.51.100.10)."
  }
}

variable "etcd_endpoints" {
  type        = list(string)
  description = "Client URLs of the global plane's etcd (module global's etcd_client_urls, or your own members): https:// with etcd_ca_cert, etcd_client_cert and etcd_client_key; http:// only without them."

  validation {
    condition     = length(var.etcd_endpoints) > 0 && (alltrue([for url in var.etcd_endpoints : can(regex("^https://[^/?#]+/?$", url))]) || alltrue([for url in var.etcd_endpoints : can(regex("^http://[^/?#]+/?$", url))]))
    error_message = "etcd_endpoints must hold at least one https://host:2379 URL (or http://host:2379 ones), all of one scheme: the agent never mixes TLS and plaintext members."
  }
  validation {
    condition     = alltrue([for url in var.etcd_endpoints : startswith(url, "https://")]) || (var.etcd_ca_cert == null && var.etcd_client_cert == null && var.etcd_client_key == null)
    error_message = "etcd_endpoints are plaintext http:// but etcd_ca_cert, etcd_client_cert or etcd_client_key is set: write https:// URLs (the agent refuses TLS files beside http:// members rather than ignore them)."
  }
  # The rules that tie the TLS inputs to the URLs live here, not on the TLS inputs: Terraform
  # refuses validations of two variables that refer to each other (a cycle).
  validation {
    condition     = var.etcd_ca_cert != null || !alltrue([for url in var.etcd_endpoints : startswith(url, "https://")])
    error_message = "https:// etcd_endpoints need etcd_ca_cert, the PEM CA of the members' certificates: the agent never dials an https:// member it cannot verify."
  }
  validation {
    condition     = (var.etcd_client_cert != null && var.etcd_client_key != null) || !alltrue([for url in var.etcd_endpoints : startswith(url, "https://")])
    error_message = "https:// etcd_endpoints need etcd_client_cert and etcd_client_key: the region's client certificate (CN agent-<region_id>) and its key are its identity in etcd."
  }
}

variable "etcd_ca_cert" {
  type        = string
  description = "PEM CA that signed the etcd members' certificates (region.etcd_ca_file): module global's etcd_ca_cert. Required with https:// etcd_endpoints; null with http:// ones."
  default     = null

  validation {
    condition     = var.etcd_ca_cert == null || can(regex("-----BEGIN CERTIFICATE-----[^-]+-----END CERTIFICATE-----", var.etcd_ca_cert))
    error_message = "etcd_ca_cert must be a PEM certificate (-----BEGIN CERTIFICATE----- ... -----END CERTIFICATE-----)."
  }
}

variable "etcd_client_cert" {
  type        = string
  description = "PEM client certificate of the region's agents for etcd (region.etcd_cert_file), signed by the etcd CA, CN agent-<region_id>: the etcd user that `meridian-controller etcd bootstrap` (module global's etcd-bootstrap Job) gives this region's role. Required with https:// etcd_endpoints."
  default     = null

  validation {
    condition     = var.etcd_client_cert == null || can(regex("-----BEGIN CERTIFICATE-----[^-]+-----END CERTIFICATE-----", var.etcd_client_cert))
    error_message = "etcd_client_cert must be a PEM certificate (-----BEGIN CERTIFICATE----- ... -----END CERTIFICATE-----)."
  }
}

variable "etcd_client_key" {
  type        = string
  description = "Unencrypted PEM private key of etcd_client_cert (region.etcd_key_file). Required with https:// etcd_endpoints."
  default     = null
  sensitive   = true

  validation {
    condition     = var.etcd_client_key == null || (can(regex("-----BEGIN ([A-Z]+ )?PRIVATE KEY-----", var.etcd_client_key)) && !can(regex("ENCRYPTED", var.etcd_client_key)))
    error_message = "etcd_client_key must be an unencrypted PEM private key (-----BEGIN PRIVATE KEY----- or -----BEGIN EC PRIVATE KEY-----): the agent reads it without a passphrase."
  }
}

variable "model" {
  type        = string
  description = "The model vLLM serves (a Hugging Face id or a path on the model volume), e.g. meta-llama/Llama-3.1-8B-Instruct."

  validation {
    condition     = length(trimspace(var.model)) > 0
    error_message = "model must name the model to serve (e.g. meta-llama/Llama-3.1-8B-Instruct)."
  }
}

variable "vllm_image" {
  type        = string
  description = "vLLM's OpenAI server image, pinned by digest, e.g. docker.io/vllm/vllm-openai@sha256:<64 hex>."

  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.vllm_image))
    error_message = "vllm_image must be pinned by digest: <repository>@sha256:<64 hex digits>."
  }
}

variable "agent_image" {
  type        = string
  description = "Meridian's image (deploy/container/Containerfile), pinned by digest."

  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.agent_image))
    error_message = "agent_image must be pinned by digest: <repository>@sha256:<64 hex digits>."
  }
}

variable "vllm_replicas" {
  type        = number
  description = "vLLM pods (nodes) in the region."
  default     = 2

  validation {
    condition     = var.vllm_replicas >= 1 && floor(var.vllm_replicas) == var.vllm_replicas
    error_message = "vllm_replicas must be a whole number of at least 1."
  }
}

variable "gpus_per_node" {
  type        = number
  description = "GPUs (nvidia.com/gpu) of one vLLM pod; vLLM's --tensor-parallel-size."
  default     = 1

  validation {
    condition     = contains([1, 2, 4, 8], var.gpus_per_node)
    error_message = "gpus_per_node must be 1, 2, 4 or 8 (vLLM's tensor parallelism divides the model's attention heads)."
  }
}

variable "agent_replicas" {
  type        = number
  description = "Agent pods, each on its own host; at least 2, so that a rolling update (one agent stopped at a time) or a lost node leaves one serving."
  default     = 2

  validation {
    condition     = var.agent_replicas >= 1 && floor(var.agent_replicas) == var.agent_replicas
    error_message = "agent_replicas must be a whole number of at least 1 (2 or more to survive a node)."
  }
}

variable "agent_shutdown_delay_s" {
  type        = number
  description = "Seconds a stopping agent pod keeps serving before it gets SIGTERM (its preStop sleep), so that the load balancer stops sending it new connections first: about your balancer's health-check interval times its unhealthy threshold."
  default     = 5

  validation {
    condition     = var.agent_shutdown_delay_s >= 0 && var.agent_shutdown_delay_s <= 60 && floor(var.agent_shutdown_delay_s) == var.agent_shutdown_delay_s
    error_message = "agent_shutdown_delay_s must be a whole number of seconds from 0 to 60."
  }
}

variable "slots_per_node" {
  type        = number
  description = "Most requests the agents keep in flight on one vLLM pod (queue.slots_per_node)."
  default     = 64

  validation {
    condition     = var.slots_per_node >= 1 && floor(var.slots_per_node) == var.slots_per_node
    error_message = "slots_per_node must be a whole number of at least 1."
  }
}

variable "vllm_port" {
  type        = number
  description = "Port vLLM listens on in its pod."
  default     = 8000

  validation {
    condition     = var.vllm_port >= 1024 && var.vllm_port <= 65535 && floor(var.vllm_port) == var.vllm_port
    error_message = "vllm_port must be a whole number from 1024 to 65535 (the pods run without privileges)."
  }
}

variable "agent_port" {
  type        = number
  description = "Port the agent listens on in its pod (server.port)."
  default     = 8080

  validation {
    condition     = var.agent_port >= 1024 && var.agent_port <= 65535 && floor(var.agent_port) == var.agent_port
    error_message = "agent_port must be a whole number from 1024 to 65535 (the pods run without privileges)."
  }
}

variable "public_port" {
  type        = number
  description = "Port of the agents' load balancer, the port in endpoints (443 for https:// without one)."
  default     = 443

  validation {
    condition     = var.public_port >= 1 && var.public_port <= 65535 && floor(var.public_port) == var.public_port
    error_message = "public_port must be a whole number from 1 to 65535."
  }
}

variable "load_balancer_ip" {
  type        = string
  description = "Address reserved for the agents' load balancer (the host of endpoints); null lets the cloud pick one."
  default     = null

  validation {
    condition     = var.load_balancer_ip == null || can(cidrhost("${coalesce(var.load_balancer_ip, "0.0.0.0")}/32", 0)) || can(cidrhost("${coalesce(var.load_balancer_ip, "::")}/128", 0))
    error_message = "load_balancer_ip must be an IPv4 or IPv6 address, or null."
  }
}

variable "load_balancer_annotations" {
  type        = map(string)
  description = "Annotations of the agents' LoadBalancer Service: the cloud's TLS termination, internal/external, address pool."
  default     = {}
}

variable "admin_token" {
  type        = string
  description = "Bearer token of the agents' /admin/* API (a long random string: meridianctl token new prints one)."
  sensitive   = true

  validation {
    condition     = length(var.admin_token) >= 32
    error_message = "admin_token must be at least 32 characters: use `meridianctl token new --name <who> --role admin` and take the token it prints."
  }
}

variable "hf_token" {
  type        = string
  description = "Hugging Face token for gated models (HF_TOKEN of the vLLM pods); empty for open models."
  default     = ""
  sensitive   = true
}

variable "model_cache_size" {
  type        = string
  description = "Persistent volume of each vLLM pod for the model's weights (HF_HOME), e.g. 200Gi."
  default     = "200Gi"

  validation {
    condition     = can(regex("^[0-9]+(Mi|Gi|Ti)$", var.model_cache_size))
    error_message = "model_cache_size must be a quantity in Mi, Gi or Ti (e.g. 200Gi)."
  }
}

variable "storage_class_name" {
  type        = string
  description = "Storage class of the model volumes; null: the cluster's default."
  default     = null
}

variable "gpu_node_selector" {
  type        = map(string)
  description = "Node labels the vLLM pods must run on, e.g. { \"nvidia.com/gpu.product\" = \"NVIDIA-H100-80GB-HBM3\" }."
  default     = {}
}

variable "vllm_resources" {
  type = object({
    cpu    = string
    memory = string
  })
  description = "CPU and memory of one vLLM pod (requests = limits), besides its GPUs."
  default = {
    cpu    = "8"
    memory = "64Gi"
  }
}

variable "agent_resources" {
  type = object({
    cpu    = string
    memory = string
  })
  description = "CPU and memory of one agent pod (requests = limits). The agent runs one worker per CPU of it (workers.count = 0), each with its own prefix index, ~65 MiB at its default size."
  default = {
    cpu    = "2"
    memory = "1Gi"
  }
}
