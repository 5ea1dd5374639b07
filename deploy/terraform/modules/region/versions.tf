terraform {
  # 1.9: a validation block may refer to other variables (https:// etcd_endpoints need
  # etcd_ca_cert, etcd_client_cert and etcd_client_key).
  required_version = ">= 1.9.0, < 2.0.0"

  required_providers {
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = "~> 2.35"
    }
  }
}
