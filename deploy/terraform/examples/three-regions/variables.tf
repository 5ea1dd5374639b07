variable "kubeconfig_path" {
  type        = string
  description = "kubeconfig holding a context for each of the three clusters."
  default     = "~/.kube/config"
}

variable "kube_contexts" {
  type        = map(string)
  description = "The kubeconfig context of each region's cluster."
  default = {
    "us-east"    = "us-east"
    "eu-west"    = "eu-west"
    "eu-central" = "eu-central"
  }

  validation {
    condition     = alltrue([for region in ["us-east", "eu-west", "eu-central"] : contains(keys(var.kube_contexts), region)])
    error_message = "kube_contexts must name a context for us-east, eu-west and eu-central."
  }
}

variable "meridian_image" {
  type        = string
  description = "Meridian's image (deploy/container/Containerfile) as pushed to your registry, pinned by digest."

  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.meridian_image))
    error_message = "meridian_image must be pinned by digest: <repository>@sha256:<64 hex digits>."
  }
}

variable "vllm_image" {
  type        = string
  description = "vLLM's OpenAI server image, pinned by digest."

  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.vllm_image))
    error_message = "vllm_image must be pinned by digest: <repository>@sha256:<64 hex digits>."
  }
}

variable "etcd_image" {
  type        = string
  description = "etcd's image (v3.5), pinned by digest."

  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.etcd_image))
    error_message = "etcd_image must be pinned by digest: <repository>@sha256:<64 hex digits>."
  }
}

variable "bind_image" {
  type        = string
  description = "BIND9's image (9.18), pinned by digest."

  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.bind_image))
    error_message = "bind_image must be pinned by digest: <repository>@sha256:<64 hex digits>."
  }
}

variable "agent_admin_tokens" {
  type        = map(string)
  description = "Each region's agent admin token (`meridianctl token new --name agent-<region> --role admin` prints one)."
  sensitive   = true
}

variable "hf_token" {
  type        = string
  description = "Hugging Face token for the gated Llama weights."
  sensitive   = true
  default     = ""
}

variable "tsig_secret" {
  type        = string
  description = "TSIG secret of the views' keys (`tsig-keygen -a hmac-sha256 meridian`)."
  sensitive   = true
}

variable "admin_tls_cert" {
  type        = string
  description = "PEM certificate of the admin API, naming module.global's admin_tls_dns_names and admin_tls_ip_addresses (IP:10.30.0.91, meridianctl's MERIDIAN_URL)."
}

variable "admin_tls_key" {
  type        = string
  description = "PEM private key of admin_tls_cert."
  sensitive   = true
}

variable "etcd_ca_cert" {
  type        = string
  description = "PEM CA of etcd: it signed the members' certificate and every client certificate below."
}

variable "etcd_member_cert" {
  type        = string
  description = "PEM certificate of the etcd members (serverAuth and clientAuth), naming module.global's etcd_tls_dns_names and etcd_tls_ip_addresses (IP:10.30.0.100)."
}

variable "etcd_member_key" {
  type        = string
  description = "PEM private key of etcd_member_cert (unencrypted)."
  sensitive   = true
}

variable "controller_etcd_cert" {
  type        = string
  description = "PEM client certificate of the controllers for etcd, CN meridian-controller."
}

variable "controller_etcd_key" {
  type        = string
  description = "PEM private key of controller_etcd_cert (unencrypted)."
  sensitive   = true
}

variable "etcd_root_cert" {
  type        = string
  description = "PEM client certificate with CN root, for the etcd-bootstrap Job only."
}

variable "etcd_root_key" {
  type        = string
  description = "PEM private key of etcd_root_cert (unencrypted)."
  sensitive   = true
}

variable "agent_etcd_certs" {
  type        = map(string)
  description = "Each region's client certificate for etcd (PEM), CN agent-<region>: its etcd user, which may write only that region's keys."

  validation {
    condition     = alltrue([for region in ["us-east", "eu-west", "eu-central"] : contains(keys(var.agent_etcd_certs), region)])
    error_message = "agent_etcd_certs must hold a certificate for us-east, eu-west and eu-central (CN agent-us-east, agent-eu-west, agent-eu-central)."
  }
}

variable "agent_etcd_keys" {
  type        = map(string)
  description = "The private key of each region's etcd client certificate (PEM, unencrypted), by region."
  sensitive   = true

  validation {
    condition     = alltrue([for region in ["us-east", "eu-west", "eu-central"] : contains(keys(var.agent_etcd_keys), region)])
    error_message = "agent_etcd_keys must hold the key of us-east's, eu-west's and eu-central's etcd client certificates."
  }
}
